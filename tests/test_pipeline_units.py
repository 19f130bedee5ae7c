"""Ray-free parts of the pipeline: request expansion and ids, row schemas, batch planning, progress."""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest

from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.pipeline.config import TaskSection
from vlbatch.pipeline.stages.requests import expand, pending, request_id
from vlbatch.pipeline.stages.rows import (
    TENSOR_TYPE,
    Decoded,
    Generated,
    MediaTask,
    Prepared,
    from_table,
    to_table,
)
from vlbatch.pipeline.telemetry.progress import Progress


def test_request_ids_hash_run_independent_inputs():
    a = request_id("s3://b/x.jpg", 0, "Describe.")
    assert a == request_id("s3://b/x.jpg", 0, "Describe.") and len(a) == 32
    assert len({a, request_id("s3://b/x.jpg", 1, "Describe."), request_id("s3://b/y.jpg", 0, "Describe."),
                request_id("s3://b/x.jpg", 0, "Describe!")}) == 4


def test_caption_and_question_expansion():
    cap = TaskSection(prompt="P img", video_prompt="P vid")
    assert expand("a/x.JPG", None, None, cap).prompts == ("P img",)
    v = expand("a/x.mp4", None, None, cap)
    assert v.media_type == "video" and v.prompts == ("P vid",) and v.request_indices == (0,)
    qa = TaskSection(mode="questions", questions=("default?",))
    r = expand("a/x.png", "image", ["q1", "q2", "q3"], qa)
    assert r.prompts == ("q1", "q2", "q3") and r.request_indices == (0, 1, 2)
    assert r.ids == tuple(request_id("a/x.png", i, q) for i, q in enumerate(["q1", "q2", "q3"]))
    assert expand("a/x.png", None, None, qa).prompts == ("default?",)
    assert expand("a/x.png", None, '["j1", "j2"]', qa).prompts == ("j1", "j2")  # CSV cell: JSON list


def test_unusable_rows_become_error_rows_not_drops():
    bad_ext = expand("a/file.xyz", None, None, TaskSection())
    assert bad_ext.status == "error" and bad_ext.error_type == "InputError" and len(bad_ext.ids) == 1
    bad_type = expand("a/x.jpg", "audio", None, TaskSection())
    assert bad_type.error_type == "InputError" and "'image', 'video'" in bad_type.error_message
    no_q = expand("a/x.jpg", None, [], TaskSection(mode="questions", questions=()))
    assert no_q.status == "error" and "no questions" in no_q.error_message


def test_pending_drops_only_committed_requests():
    r = expand("a/x.png", None, ["q1", "q2", "q3"], TaskSection(mode="questions", questions=("z",)))
    p = pending(r, {r.ids[1]})
    assert p.ids == (r.ids[0], r.ids[2]) and p.request_indices == (0, 2) and p.prompts == ("q1", "q3")
    assert pending(r, set(r.ids)) is None and pending(r, set()) is r


def test_rows_round_trip_through_arrow_with_variable_tensors():
    d = [Decoded("u1", "image", ("i",), (0,), ("p",), frames=np.arange(2 * 3 * 3, dtype=np.uint8).reshape(1, 2, 3, 3)),
         Decoded("u2", "video", ("j", "k"), (0, 1), ("p", "q"), frames=np.ones((4, 5, 6, 3), np.uint8),
                 source_fps=25.0, total_frames=40, frame_indices=(0, 10, 20, 30)),
         Decoded("u3", "image", ("l",), (0,), ("p",)).failed(ValueError("x"))]
    t = to_table(d, Decoded)
    assert t.schema.field("frames").type == TENSOR_TYPE  # a tensor column, not pickled objects
    back = from_table(t, Decoded)
    for a, b in zip(d, back, strict=True):
        assert np.array_equal(a.frames, b.frames) and a.frames.shape == b.frames.shape
        assert (a.ids, a.frame_indices, a.status, a.error_type) == (b.ids, b.frame_indices, b.status, b.error_type)
    p = Prepared("u", "image", ("i", "j"), (0, 1), ("p", "q"),
                 pixels=np.random.default_rng(0).integers(0, 256, (1, 32, 64, 3), dtype=np.uint8), grid_thw=(1, 2, 4),
                 content_hash="h", input_ids=((1, 2, 3), (4, 5)), spans=((1, 3), (0, 1, 2, 3)),
                 positions=np.arange(15, dtype=np.int64).reshape(3, 5), rope_deltas=(-3, -2), visual_tokens=2)
    q = from_table(to_table([p], Prepared), Prepared)[0]
    assert np.array_equal(q.pixels, p.pixels) and q.pixels.dtype == np.uint8 and q.pixels.shape == (1, 32, 64, 3)
    assert q.input_ids == p.input_ids and q.rope_deltas == (-3, -2) and q.content_hash == "h"
    assert q.prompt_spans(0) == ((1, 3),) and q.prompt_spans(1) == ((0, 1), (2, 3))
    assert q.positions.dtype == np.int64 and np.array_equal(q.positions, p.positions)
    assert np.array_equal(q.prompt_positions(0), [[0, 1, 2], [5, 6, 7], [10, 11, 12]])
    assert np.array_equal(q.prompt_positions(1), [[3, 4], [8, 9], [13, 14]])
    g = Generated("u", "image", ("i",), (0,), ("p",), answers=(None,), statuses=("error",))
    assert from_table(to_table([g], Generated), Generated)[0].answers == (None,)
    assert to_table([MediaTask("u", "image", ("i",), (0,), ("p",))], MediaTask).num_rows == 1


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_logs_periodically_when_not_a_terminal():
    clock, out = _Clock(), io.StringIO()
    p = Progress(total=4, stream=out, interval_s=10.0, tty=False, clock=clock)
    stats = pa.table({"id": ["a", "b"], "status": ["ok", "error"], "error_type": [None, "MediaError"],
                      "prompt_tokens": [100, None], "visual_tokens": [64, None], "generated_tokens": [8, None],
                      "cached_tokens": [50, None], "file": ["f1", "f1"]})
    clock.t = 2.0
    p.update(stats)
    assert out.getvalue() == ""  # within the interval: silent
    clock.t = 11.0
    p.update(stats.slice(0, 1))
    line = out.getvalue()
    assert "3/4 rows" in line and "errors 1" in line and "prefix-hit 50%" in line and "ETA 00:03" in line
    r = p.rates()
    assert r["time_to_first_row_s"] == 2.0
    assert abs(r["rows_per_s"] - 3 / 11) < 1e-9 and abs(r["generated_tokens_per_s"] - 16 / 11) < 1e-9
    p.tick(final=True)
    assert out.getvalue().count("vlbatch progress") == 1  # nothing new since the last line: no repeat
    clock.t = 12.0
    p.update(stats.slice(1, 1))  # within the interval: silent until the final line
    p.tick(final=True)
    assert out.getvalue().count("vlbatch progress") == 2 and "4/4 rows" in out.getvalue().splitlines()[-1]


def test_write_stage_explodes_media_rows_into_one_fixed_schema(tmp_path):
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.operators.sink.schema import OUTPUT_SCHEMA
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.stages.write_stage import write_batch

    ok = Generated("u1", "image", ("a", "b"), (0, 1), ("p0", "p1"), answers=("x", None), thinking=(None, None),
                   statuses=("ok", "error"), req_error_types=(None, "EngineError"), req_error_messages=(None, "oom"),
                   finish_reasons=("stop", None), prompt_tokens=(10, 11), generated_tokens=(2, None),
                   cached_tokens=(0, 9), visual_tokens=4, decode_s=0.5, preprocess_s=0.25, model_s=1.0,
                   vision_hits=1, vision_encodes=1, batch_model_s=1.0)
    bad = Generated("u2", "video", ("c",), (0,), ("p",), status="error", error_type="MediaError",
                    error_message="empty", answers=(None,), thinking=(None,), statuses=("error",),
                    req_error_types=("MediaError",), req_error_messages=("empty",), finish_reasons=(None,),
                    prompt_tokens=(None,), generated_tokens=(None,), cached_tokens=(None,))
    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}})
    stats = write_batch(to_table([ok, bad], Generated), cfg=cfg, run_dir=str(tmp_path / "r"), run_id="r")
    assert stats.column("id").to_pylist() == ["a", "b", "c"]
    assert stats.column("vision_hits").to_pylist() == [1, 0, 0]  # media figures once, on the first request
    out = ParquetSink(str(tmp_path / "r")).read()
    assert out.schema.equals(OUTPUT_SCHEMA)
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows["a"]["status"] == "ok" and rows["a"]["answer"] == "x" and rows["a"]["timings"]["model_s"] == 1.0
    assert rows["b"]["status"] == "error" and rows["b"]["error_type"] == "EngineError" and rows["b"]["answer"] is None
    assert rows["c"]["error_type"] == "MediaError" and rows["c"]["media_type"] == "video"
    assert {r["run_id"] for r in rows.values()} == {"r"} and rows["a"]["request_index"] == 0


def test_one_media_extension_table_and_m4a_is_audio():
    from vlbatch.operators.media.load import media_type_of
    from vlbatch.pipeline.stages.requests import infer_media_type

    for uri in ("a/x.JPG", "s3://b/y.jfif", "z.png?sig=1", "clip.3gp", "clip.MP4", "v.webm"):
        assert infer_media_type(uri, None) == media_type_of(uri, b"")  # the manifest and the loader agree
    assert infer_media_type("clip.3gp", None) == "video" and infer_media_type("p.jfif", None) == "image"
    with pytest.raises(InputError, match="audio"):
        infer_media_type("song.m4a", None)
    assert expand("song.m4a", None, None, TaskSection()).error_type == "InputError"
    assert infer_media_type("song.m4a", "video") == "video"  # an explicit media_type still wins


def test_job_config_dtypes_are_the_loader_dtypes():
    import typing

    import torch

    from vlbatch.operators.model.loader import DTYPES, torch_dtype
    from vlbatch.pipeline.config import ModelSection

    assert set(typing.get_args(ModelSection.model_fields["dtype"].annotation)) == set(DTYPES)
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype(torch.float16) is torch.float16
    with pytest.raises(ConfigError, match="unsupported dtype"):
        torch_dtype("float64")


def test_columnar_output_tables_match_the_per_row_reference():
    """`output_tables` (Arrow kernels) == `output_tables_naive` (one OutputRow per request) on odd
    batches: mixed ok / error requests in one media, a media error, 0 visual tokens, answers on
    error requests (dropped), media of 1..5 requests, a null media_uri, an empty batch."""
    from vlbatch.pipeline.stages.write_stage import output_tables, output_tables_naive

    def gen(j, n, *, err=False, visual=64):
        st = tuple("error" if err or (j + i) % 3 == 2 else "ok" for i in range(n))
        return Generated(None if j == 4 else f"u{j}", "video" if j % 2 else "image", tuple(f"id{j}-{i}" for i in range(n)),
                         tuple(range(n)), tuple(f"p{i}" * (i + 1) for i in range(n)),
                         status="error" if err else "ok", error_type="MediaError" if err else None,
                         answers=tuple(f"a{i}" for i in range(n)), thinking=tuple(None if i else "t" for i in range(n)),
                         statuses=st, req_error_types=tuple(None if s == "ok" else "EngineError" for s in st),
                         req_error_messages=tuple(None if s == "ok" else f"m{i}" for i, s in enumerate(st)),
                         finish_reasons=tuple("stop" if s == "ok" else None for s in st),
                         prompt_tokens=tuple(10 + i for i in range(n)), generated_tokens=tuple(i for i in range(n)),
                         cached_tokens=tuple(None if i == 1 else 3 for i in range(n)), visual_tokens=visual,
                         decode_s=0.1 * j, preprocess_s=0.2, model_s=1.5, vision_hits=j, vision_encodes=1,
                         batch_model_s=0.5 * j, batch_model_cpu_s=0.25)

    batches = [[gen(j, 1 + j % 5, err=j == 3, visual=0 if j == 2 else 64) for j in range(9)], [gen(7, 2)], []]
    for rows in batches:
        table = to_table(rows, Generated)
        fast, ref = output_tables(table, "m", "r"), output_tables_naive(table, "m", "r")
        assert fast[0].equals(ref[0]), (fast[0].to_pylist()[:3], ref[0].to_pylist()[:3])
        assert fast[1].equals(ref[1]), (fast[1].to_pylist()[:3], ref[1].to_pylist()[:3])
    assert fast[0].num_rows == 0 and ref[0].num_rows == 0
    one = output_tables(to_table(batches[0], Generated), "m", "r")[1]
    assert one.column("vision_hits").to_pylist()[:3] == [0, 1, 0]  # media 1's figures on its first request only
