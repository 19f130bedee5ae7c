"""A rerun of a complete clipped run starts no Ray (issue 51 on issue 50's check).

A clipped video's request ids are its clips' (`requests.clip_request_id`), known only once the video is
decoded; the rows of a video's last clip say `clip_last`, so the driver's check
(`pipeline/startup/nothing_to_do.py`) tells a complete video from its committed rows without decoding. Here
on a real Parquet sink with rows built in the output schema: complete videos are nothing to do; a missing
clip, or clips committed without a last one (rows from before the marker), is work left; a video whose
whole file failed (one permanent error row under its own id) is done. The decode stage's rows carry the
marker on the last clip only (a real encoded video)."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from test_clips import _video

from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA
from vlbatch.pipeline.stages.requests import clip_request_id, request_id

PROMPT = "What happens?"


def _plan(tmp_path: Path, ckpt, *sets):
    from vlbatch.pipeline.config import load_config
    from vlbatch.pipeline.plan.cluster import local_cluster
    from vlbatch.pipeline.plan.preflight import preflight

    man = tmp_path / "m.jsonl"
    man.write_text("".join(json.dumps({"media_uri": str(tmp_path / n)}) + "\n" for n in ("a.mp4", "b.mp4", "i.png")))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {{path: {ckpt}, dtype: float32, device: cpu}}\n"
                   f"input: {{uri: {man}, format: jsonl}}\n"
                   f"task: {{mode: caption, prompt: Describe., video_prompt: '{PROMPT}'}}\n"
                   "video: {clips: {mode: fixed, window_s: 2.0}}\n"
                   f"output: {{uri: {tmp_path / 'out'}, run_id: r}}\n")
    return preflight(load_config(cfg, list(sets)), local_cluster())


def _commit(run_dir: Path, rows: list[dict]) -> None:
    """Rows in OUTPUT_SCHEMA: each dict gives id and the clip fields (and status / error_type)."""
    n = len(rows)
    base = {"status": "ok", "run_id": "r", "request_index": 0, "media_type": "video", "prompt": PROMPT, "model": "m"}
    cols = {f.name: pa.array([{**base, **r}.get(f.name) for r in rows], f.type) for f in OUTPUT_SCHEMA}
    assert n
    sink = ParquetSink(str(run_dir))
    sink.prepare()
    sink.commit(pa.table(cols, schema=OUTPUT_SCHEMA))


def _clips(tmp_path, name: str, n: int, *, last: bool = True) -> list[dict]:
    rid = request_id(str(tmp_path / name), 0, PROMPT)
    return [{"id": clip_request_id(rid, k), "clip_index": k, "clip_last": last and k == n - 1} for k in range(n)]


def test_a_complete_clipped_run_is_nothing_to_do_and_a_missing_clip_is_work(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.startup.nothing_to_do import nothing_to_do

    ckpt = tiny_ckpt("dense")
    plan = _plan(tmp_path, ckpt)
    run_dir = tmp_path / "out" / "r"
    image = {"id": request_id(str(tmp_path / "i.png"), 0, "Describe."), "media_type": "image", "prompt": "Describe."}
    a, b = _clips(tmp_path, "a.mp4", 3), _clips(tmp_path, "b.mp4", 2)
    assert nothing_to_do(plan) is None  # a fresh run
    _commit(run_dir, a + [image])
    assert nothing_to_do(plan) is None  # b.mp4 not cut yet
    _commit(run_dir, b[1:])
    assert nothing_to_do(plan) is None  # b.mp4's clip 0 missing (its last clip is there)
    _commit(run_dir, b[:1])
    done = nothing_to_do(plan)
    assert done is not None and done.requests == 6 and done.exit_code == 0, done
    assert done.line() == f"[vlbatch] nothing to do: all 6 requests of {run_dir}/ are committed"

    for p in run_dir.glob("part-*.parquet"):
        p.unlink()
    _commit(run_dir, _clips(tmp_path, "a.mp4", 3, last=False) + b + [image])  # a.mp4: no clip marked last
    assert nothing_to_do(plan) is None

    for p in run_dir.glob("part-*.parquet"):
        p.unlink()
    whole = {"id": request_id(str(tmp_path / "b.mp4"), 0, PROMPT), "status": "error", "error_type": "MediaError"}
    _commit(run_dir, a + [image, whole])  # b.mp4 is not a video: its one permanent error row
    done = nothing_to_do(plan)
    assert done is not None and (done.requests, done.errors) == (5, 1), done


def test_decode_stage_marks_only_the_last_clip(tmp_path):
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.rows import Decoded, MediaTask, from_table, to_table

    data = _video(tmp_path, 50)  # 5 s at 10 fps: windows of 2 s, the last 1 s one kept (min_clip_s 1)
    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "in.parquet"}, "output": {"uri": "out"},
                           "video": {"fps": 2.0, "min_frames": 2, "clips": {"mode": "fixed", "window_s": 2.0}}})
    task = MediaTask("v.mp4", "video", ("a" * 32,), (0,), (PROMPT,), media_bytes=data)
    img = MediaTask("i.png", "image", ("c" * 32,), (0,), (PROMPT,), status="error", error_type="InputError")
    stage = DecodeStage(cfg)
    try:
        rows = [r for t in stage(to_table([task, img], MediaTask)) for r in from_table(t, Decoded)]
    finally:
        stage.worker.close()
    assert [(r.clip_index, r.clip_last) for r in rows] == [(0, False), (1, False), (2, True), (None, None)]


def test_with_last_hands_the_held_item_on_before_an_error():
    import pytest

    from vlbatch.pipeline.stages.clip_rows import with_last

    def items():
        yield 1
        yield 2
        raise ValueError("cut short")

    got = []
    with pytest.raises(ValueError):
        for x in with_last(items()):
            got.append(x)
    assert got == [(1, False), (2, False)]
    assert list(with_last([])) == [] and list(with_last([7])) == [(7, True)]
