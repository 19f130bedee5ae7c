"""Scan mode counts clips (issue 51): `task.mode: scan` with `video.clips` cuts each video as the run
will (one decode, the detector on small frames) and writes one scan row per clip and prompt with its
times, source and token cost, before any model runs (`pipeline/stages/scan.py`). Real encoded video
with hard cuts at known frames (`test_clips.CUTS`); a video whose header claims more frames than decode
is scanned as the run would cut it; a file that is not a video is one error row. The tiny checkpoint
gives the processor (no model is loaded)."""
from __future__ import annotations

import pytest
from test_clips import CUTS, FPS, MIN, _video, scenes_pattern

from vlbatch.devtools.samples import encode_video
from vlbatch.pipeline.config import validate_config

PROMPT = "Describe the clip."


def _scan(tiny_ckpt, clips: dict):
    from vlbatch.pipeline.stages.scan import ScanStage

    cfg = validate_config({**MIN, "model": {"path": str(tiny_ckpt("dense"))}, "task": {"mode": "scan"},
                           "video": {"fps": 2.0, "min_frames": 2, "max_pixels": 12544, "clips": clips}})
    return ScanStage(cfg)


def _rows(stage, *tasks):
    from vlbatch.pipeline.stages.rows import Generated, MediaTask, from_table, to_table

    try:
        return from_table(stage(to_table(list(tasks), MediaTask)), Generated)
    finally:
        stage.prepare.decode.worker.close()


def _task(uri: str, data: bytes, rid: str):
    from vlbatch.pipeline.stages.rows import MediaTask

    return MediaTask(uri, "video", (rid,), (0,), (PROMPT,), media_bytes=data)


@pytest.mark.slow
def test_scan_cuts_scenes_and_prices_each_clip(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.stages.requests import clip_request_id

    data = _video(tmp_path, 90)  # 9 s at 10 fps, scenes starting at frames 0, 23, 57, 71
    bad = _task("bad.mp4", b"not a video" * 9, "b" * 32)
    rows = _rows(_scan(tiny_ckpt, {"mode": "scenes", "window_s": 10.0, "min_clip_s": 0.5}),
                 _task("v.mp4", data, "a" * 32), bad)
    clips, (err,) = rows[:-1], rows[-1:]
    assert [r.clip_index for r in clips] == [0, 1, 2, 3]
    starts = [r.clip_start_s for r in clips]
    assert all(abs(s - c / FPS) <= 1 / FPS for s, c in zip(starts[1:], CUTS, strict=True)), starts  # within a frame
    assert [r.clip_end_s for r in clips[:-1]] == starts[1:] and clips[-1].clip_end_s == 9.0
    assert {r.clip_source for r in clips} == {"scenes"} and [r.clip_last for r in clips] == [False] * 3 + [True]
    assert [r.ids for r in clips] == [(clip_request_id("a" * 32, k),) for k in range(4)]
    assert all(r.status == "ok" and r.answers == (None,) for r in clips)
    assert all(r.visual_tokens > 0 and r.prompt_tokens[0] > r.visual_tokens for r in clips)
    # the whole file fails: one error row under the video's own id, no clip fields
    assert (err.ids, err.status, err.error_type, err.clip_index) == (bad.ids, "error", "MediaError", None)


def test_scan_of_a_lying_header_counts_the_clips_that_decode(tmp_path, tiny_ckpt):
    path = tmp_path / "long.mp4"
    encode_video(path, 120, 128, 96, FPS, options={"g": "12", "bf": "2"}, pattern=scenes_pattern,
                 container_options={"movflags": "+faststart"})
    full = path.read_bytes()
    cut = full[: len(full) // 2]  # the header (first) says 12 s; half the data is there
    rows = _rows(_scan(tiny_ckpt, {"mode": "fixed", "window_s": 2.0, "min_clip_s": 0.1}),
                 _task("long.mp4", cut, "c" * 32))
    assert rows and all(r.status == "ok" for r in rows)
    ends = [r.clip_end_s for r in rows]
    assert ends[-1] < 12.0 and [r.clip_start_s for r in rows] == [2.0 * k for k in range(len(rows))]
    assert rows[-1].clip_last and not any(r.clip_last for r in rows[:-1])


def test_validate_accepts_a_clipped_scan_and_the_line_reports_clips():
    from vlbatch.pipeline.stages.scan import clip_text, scan_line
    from vlbatch.pipeline.telemetry.summary import RunSummary

    cfg = validate_config({**MIN, "task": {"mode": "scan"}, "video": {"clips": {"mode": "scenes"}}})
    assert cfg.video.clips.mode == "scenes"
    counts = {"clips": 8, "media_cut": 2, "clip_frames": 32, "clip_visual_tokens": 512}
    text = clip_text(counts)
    assert text == ("clips 8 of 2 media cut (4.0 per media), per clip 4.0 sampled frames and 64 visual tokens "
                    "(each video's clips: vlbatch inspect RUN)")
    assert clip_text({"media_cut": 3}) is None
    line = scan_line(RunSummary("r", "o", 0, 0), counts)
    assert f"; {text}" in line
    assert "clips" not in scan_line(RunSummary("r", "o", 0, 0))


@pytest.mark.parametrize("mode", ["fixed", "scenes"])
def test_plan_hands_the_scan_the_committed_ids_when_clipped(mode):
    from vlbatch.pipeline.plan.spec import stage_specs

    cfg = validate_config({**MIN, "task": {"mode": "scan"}, "video": {"clips": {"mode": mode}}})
    (spec,) = stage_specs(cfg, None)
    assert "done" in spec.runtime and "meter" in spec.runtime


@pytest.mark.ray
def test_vlbatch_scan_of_a_clipped_job_end_to_end(tmp_path, tiny_ckpt):
    """`vlbatch run` in scan mode: one row per clip, the final line's clip figures; a rerun has nothing to do."""
    import json

    from test_jobs_support import read_output, vlbatch

    _video(tmp_path, 90)  # scenes.mp4
    man = tmp_path / "m.jsonl"
    man.write_text(json.dumps({"media_uri": str(tmp_path / "scenes.mp4")}) + "\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {tiny_ckpt('dense')}, dtype: float32, device: cpu}}
input: {{uri: {man}, format: jsonl}}
task: {{mode: scan}}
video: {{fps: 2.0, min_frames: 2, max_pixels: 12544, clips: {{mode: scenes, window_s: 10.0, min_clip_s: 0.5}}}}
resources: {{preprocess: {{num_cpus: 0.5, min_actors: 1, max_actors: 1}}}}
output: {{uri: {tmp_path / 'out'}, run_id: s}}
""")
    first = vlbatch("run", str(cfg), "--no-lock", timeout=400)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    rows = sorted(read_output(tmp_path / "out" / "s"), key=lambda r: r["clip_index"])
    assert [(r["clip_index"], r["clip_source"], r["clip_last"]) for r in rows] == [
        (k, "scenes", k == 3) for k in range(4)]
    assert all(r["status"] == "ok" and r["visual_tokens"] > 0 and r["answer"] is None for r in rows)
    line = next(x for x in (first.stdout + first.stderr).splitlines() if x.startswith("vlbatch scan:"))
    assert "vlbatch scan: 4 requests, 0 errors" in line and "clips 4 of 1 media cut (4.0 per media)" in line, line
    again = vlbatch("run", str(cfg), "--no-lock", timeout=400)
    assert again.returncode == 0 and "nothing to do: all 4 requests" in again.stdout, again.stdout + again.stderr
