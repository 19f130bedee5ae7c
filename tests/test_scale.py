"""Scale machinery without Ray: the IdIndex resume index, rolling part files under kills, scan rows."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pyarrow as pa
import pytest

from vlbatch.operators.sink.base import build_index
from vlbatch.operators.sink.ids import IdIndex, id_keys
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.rolling import PartRoller, RollPolicy
from vlbatch.operators.sink.schema import OutputRow, rows_to_table
from vlbatch.pipeline.config import TaskSection
from vlbatch.pipeline.stages.requests import expand_all, request_id


def _rows(ids, status="ok", error_type=None):
    return rows_to_table([OutputRow(id=i, request_index=0, media_uri=f"/m/{i}.jpg", media_type="image", prompt="p",
                                    status=status, model="m", run_id="r", error_type=error_type) for i in ids])


def test_id_keys_vectorised_path_matches_the_per_id_path():
    ids = [request_id(f"/m/{i}.jpg", i % 3, "q") for i in range(1000)] + ["id007", "x" * 32]
    arr = pa.chunked_array([pa.array(ids[:500]), pa.array(ids[500:1000])])
    assert np.array_equal(id_keys(arr), id_keys(ids[:1000]))
    assert [bytes(k).hex() for k in id_keys(arr)[:3].view(np.uint8).reshape(3, 16)] == ids[:3]
    ix = IdIndex.of(ids[::2])
    assert ix.contains_many(ids).tolist() == [i % 2 == 0 for i in range(len(ids))]
    assert "id008" not in ix and (ix | ["id008"]) == set(ids[::2]) | {"id008"}


def test_resume_index_of_1e5_committed_ids_in_bounded_memory():
    """10^5 committed ids in 4 parts: the index holds 16 B per id, and building it peaks far below
    the ~100 B per id a Python set of the id strings costs."""
    n = 100_000
    ids = [request_id(f"s3://b/{i}.jpg", i % 4, "question") for i in range(n)]
    units = [(f"p{k}", pa.table({"id": pa.array(ids[k::4]), "status": pa.array(["ok"] * len(ids[k::4])),
                                 "error_type": pa.array([None] * len(ids[k::4]), pa.string())})) for k in range(4)]
    tracemalloc.start()
    idx = build_index(units)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(idx.done_ids) == n and idx.done_ids.nbytes == 16 * n and idx.duplicate_ids == 0
    assert peak < 48 * n, f"index build peaked at {peak / n:.0f} B per id"
    probe = ids[:10] + [request_id("s3://b/new.jpg", 0, "question")]
    assert idx.done_ids.contains_many(probe).tolist() == [True] * 10 + [False]
    # expansion against it: committed requests dropped, the rest kept
    task = TaskSection(mode="caption", prompt="question")
    rows, dropped = expand_all([("s3://b/0.jpg", None, None), ("s3://b/new.jpg", None, None)], task, idx.done_ids)
    assert [r.media_uri for r in rows] == ["s3://b/new.jpg"] and dropped == 0


def _ids(n, start=0):
    return [f"{i:032x}" for i in range(start, start + n)]


def test_rolling_writers_killed_then_sealed_or_resumed_lose_and_double_nothing(tmp_path):
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    policy = RollPolicy(target_bytes=None, target_rows=6, interval_s=1e9)
    a, b = PartRoller(sink, policy, "wa"), PartRoller(sink, policy, "wb")
    batches = [_ids(2, 2 * k) for k in range(7)]  # 14 ids in batches of 2
    for k, ids in enumerate(batches):
        (a if k % 2 == 0 else b).add(_rows(ids))
    # a: 4 batches (8 rows): 3 published at its 4th call, 1 held; b: 3 batches held (6 rows, not yet published)
    published = sink.index()
    assert len(published.done_ids) == 6 and len(sink.parts()) == 1
    held = a.held_rows + b.held_rows
    assert held == 8
    # both writers die here (the objects are dropped). The end of the stream: seal publishes the held
    # rows, exactly once
    del a, b
    sink.seal(target_rows=6)
    every = sorted(i for ids in batches for i in ids)
    assert sink.read().column("id").to_pylist() == every and sink.index().duplicate_ids == 0

    # a killed *run*: the rerun's prepare() drops what was staged; only the held window is recomputed
    sink2 = ParquetSink(str(tmp_path / "run2"))
    sink2.prepare()
    w = PartRoller(sink2, policy, "wa")
    for ids in batches[:4]:
        w.add(_rows(ids))
    sink2.prepare()  # the rerun
    done = sink2.index().done_ids
    assert len(done) == 8 - w.held_rows == 6  # the 2 held rows are recomputed, nothing else
    redo = [i for ids in batches[:4] for i in ids if i not in done]
    w2 = PartRoller(sink2, policy, "wz")
    w2.add(_rows(redo))
    sink2.seal(target_rows=6)
    assert sink2.read().column("id").to_pylist() == sorted(i for ids in batches[:4] for i in ids)


def test_batch_retried_after_its_part_was_published_is_detected_at_seal(tmp_path):
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    policy = RollPolicy(target_bytes=None, target_rows=4, interval_s=1e9)
    a = PartRoller(sink, policy, "wa")
    a.add(_rows(_ids(2)))
    a.add(_rows(_ids(2, 2)))
    a.add(_rows(_ids(1, 4)))  # publishes the first two batches, holds the third
    sink.stage(_rows(_ids(2)), "wa")  # as if the writer had died before deleting a published batch's file
    b = PartRoller(sink, policy, "wb")
    b.add(_rows(_ids(1, 4)))  # the third batch retried on another writer (its first writer died)
    sink.seal(target_rows=4)
    assert sink.read().column("id").to_pylist() == _ids(5) and sink.index().duplicate_ids == 0


def test_roller_commits_by_interval_and_alone_when_a_batch_fills_a_part(tmp_path):
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    now = [0.0]
    r = PartRoller(sink, RollPolicy(target_bytes=None, target_rows=5, interval_s=10.0), "w", clock=lambda: now[0])
    assert r.add(_rows(_ids(1))) == [] and r.add(_rows(_ids(1, 1))) == []
    now[0] = 11.0
    assert len(r.add(_rows(_ids(1, 2)))) == 1  # the first two batches: older than the interval
    big = _rows(_ids(5, 10))
    out = r.add(big)  # held batch first, then the full batch alone under its own name
    from vlbatch.operators.sink.parquet import part_name
    assert len(out) == 2 and out[1].endswith(part_name(_ids(5, 10)))
    assert len(sink.index().done_ids) == 8


@pytest.mark.parametrize("bad", [False, True])
def test_scan_rows_count_tokens_and_keep_errors(tmp_path, tiny_ckpt, bad):
    from PIL import Image

    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.stages.prepare import PrepareStage
    from vlbatch.pipeline.stages.rows import MediaTask, from_table, to_table
    from vlbatch.pipeline.stages.scan import ScanStage

    img = tmp_path / ("bad.png" if bad else "ok.png")
    if bad:
        img.write_bytes(b"\x89PNG not really")
    else:
        Image.new("RGB", (64, 48), (200, 10, 10)).save(img)
    cfg = JobConfig.model_validate({"model": {"path": str(tiny_ckpt("dense"))}, "input": {"uri": str(tmp_path)},
                                    "task": {"mode": "scan", "questions": ["a?", "what is in it?"]},
                                    "output": {"uri": str(tmp_path / "out")}, "image": {"max_pixels": 65536}})
    (task,), _ = expand_all([(str(img), None, None)], cfg.task)
    assert task.prompts == ("a?", "what is in it?")
    (g,) = from_table(ScanStage(cfg)(to_table([task], MediaTask)), __import__("vlbatch.pipeline.stages.rows",
                                                                             fromlist=["Generated"]).Generated)
    prep = PrepareStage(cfg)
    (p,) = from_table(prep(to_table([task], MediaTask)), __import__("vlbatch.pipeline.stages.rows",
                                                                    fromlist=["Prepared"]).Prepared)
    assert g.answers == (None, None) and g.generated_tokens == (None, None)
    if bad:
        assert g.statuses == ("error", "error") and g.req_error_types == ("MediaError",) * 2
        assert g.prompt_tokens == (None, None) and g.visual_tokens == 0
    else:
        assert g.statuses == ("ok", "ok") and g.visual_tokens == p.visual_tokens > 0
        assert g.prompt_tokens == tuple(len(x) for x in p.input_ids)
        assert g.prompt_tokens[1] > g.prompt_tokens[0] > g.visual_tokens


def test_scan_totals_and_histograms_from_stats_rows():
    from vlbatch.pipeline.stages.scan import scan_line
    from vlbatch.pipeline.stages.write_stage import STATS_SCHEMA
    from vlbatch.pipeline.telemetry.progress import Progress, token_histogram
    from vlbatch.pipeline.telemetry.summary import RunSummary

    assert token_histogram([0, 1, 2, 3, 4, 255, 256, None]) == {"0": 1, "1-2": 1, "2-4": 2, "4-8": 1, "128-256": 1,
                                                               "256-512": 1}
    rows = [{"id": "a", "status": "ok", "prompt_tokens": 70, "visual_tokens": 64, "file": None},
            {"id": "b", "status": "ok", "prompt_tokens": 75, "visual_tokens": 64, "file": None},
            {"id": "c", "status": "error", "error_type": "MediaError", "file": None}]
    p = Progress(total=None, stream=open("/dev/null", "w"))
    p.update(pa.Table.from_pylist(rows, schema=STATS_SCHEMA))
    assert (p.prompt_tokens, p.visual_tokens) == (145, 128)
    assert dict(p.prompt_hist) == {"64-128": 2} and dict(p.visual_hist) == {"64-128": 2}
    s = RunSummary("r", "o", 0, 0, requests_computed=3, processed_by_status=dict(p.status),
                   error_types=dict(p.error_types),
                   prompt_tokens=p.prompt_tokens, visual_tokens=p.visual_tokens,
                   token_histogram={"prompt": dict(p.prompt_hist), "visual": dict(p.visual_hist)})
    line = scan_line(s)
    assert "3 requests, 1 errors" in line and "'MediaError': 1" in line and "prompt tokens 145" in line
    assert "visual histogram 64-128:2" in line and "CPU s per request" not in line  # no CPU seconds measured
    # issue 53: the measured CPU cost per request, and the cores a model replica needs at R requests/s
    costed = scan_line(RunSummary("r", "o", 0, 0, processed_by_status={"ok": 4},
                                  stage_seconds={"decode": 0.3, "preprocess": 0.1}))
    assert "decode + preprocess 0.1000 CPU s per request" in costed and "0.1000 x R CPU cores" in costed
    assert "10.0 requests/s per core" in costed


def test_scan_blocks_spread_a_row_group_over_the_actors(tmp_path):
    """Scan mode's Ray Data block size: a row group of 10^4 media (one block as read) is sliced into
    blocks of hundreds to a few thousand media (a few preprocess batches each), never one block per actor;
    other modes keep `ray.block_mb`."""
    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.plan.spec import block_bytes
    from vlbatch.pipeline.stages.rows import MediaTask, to_table

    base = {"model": {"path": "m"}, "input": {"uri": str(tmp_path)}, "output": {"uri": str(tmp_path / "o")},
            "task": {"mode": "scan", "questions": ["What is shown?", "What colour is it?", "Is there text?", "Why?"]}}
    cfg = JobConfig.model_validate(base)
    rows, _ = expand_all([(str(tmp_path / f"media/m{j:08d}.png"), None, None) for j in range(10_000)], cfg.task)
    per_media = to_table(rows, MediaTask).nbytes / len(rows)
    media_per_block = block_bytes(cfg) / per_media  # Ray slices a block past 1.5x the target
    assert 256 <= media_per_block <= 4000, media_per_block
    assert len(rows) * per_media > 1.5 * block_bytes(cfg)
    other = JobConfig.model_validate({**base, "task": {"mode": "caption"}, "ray": {"block_mb": 8}})
    assert block_bytes(other) == 8 << 20


def test_scan_actor_writes_its_rows_once_and_returns_stats(tmp_path, tiny_ckpt):
    """Scan mode's one operator: the ScanStage actor stages its scan rows itself (a retried batch
    lands on the same staged name) and returns one stats row per request; seal publishes every
    request once, with the token counts of the Generated rows."""
    from PIL import Image

    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.stages.rows import Generated, MediaTask, from_table, to_table
    from vlbatch.pipeline.stages.scan import ScanStage
    from vlbatch.pipeline.stages.write_stage import STATS_SCHEMA

    imgs = []
    for i in range(5):
        imgs.append(tmp_path / f"{i}.png")
        Image.new("RGB", (40 + 8 * i, 32), (10 * i, 0, 0)).save(imgs[-1])
    (tmp_path / "4.png").write_bytes(b"broken")
    cfg = JobConfig.model_validate({"model": {"path": str(tiny_ckpt("dense"))}, "input": {"uri": str(tmp_path)},
                                    "task": {"mode": "scan", "questions": ["a?", "b?", "c?"]},
                                    "output": {"uri": str(tmp_path / "out")}, "image": {"max_pixels": 65536}})
    tasks, _ = expand_all([(str(p), None, None) for p in imgs], cfg.task)
    run_dir = str(tmp_path / "out" / "r")
    sink = ParquetSink(run_dir)
    sink.prepare()
    actor = ScanStage(cfg, run_dir, "r")
    batches = [to_table(tasks[:3], MediaTask), to_table(tasks[3:], MediaTask)]
    stats = [actor(b) for b in batches] + [ScanStage(cfg, run_dir, "r")(batches[1])]  # a retry on another actor
    assert all(s.schema.equals(STATS_SCHEMA) for s in stats)
    assert [s.num_rows for s in stats] == [9, 6, 6] and not sink.parts()  # staged, not yet published
    sink.seal()
    out = sink.read()
    expected = from_table(ScanStage(cfg)(to_table(tasks, MediaTask)), Generated)
    assert out.num_rows == 15 and len(set(out.column("id").to_pylist())) == 15
    by_id = {r["id"]: r for r in out.to_pylist()}
    for g in expected:
        for i, rid in enumerate(g.ids):
            assert by_id[rid]["prompt_tokens"] == g.prompt_tokens[i] and by_id[rid]["status"] == g.statuses[i]
    assert sum(r["status"] == "error" for r in by_id.values()) == 3


def test_ordered_map_keeps_order_bounds_its_window_and_raises_in_turn():
    """`ordered_map` (the sink's parallel reads): results in input order whatever order the
    threads finish in, never more than 2 x threads items started ahead of the consumer, and an
    item's exception raised at that item (the ones before it delivered)."""
    import random
    import threading
    import time

    from vlbatch.operators.sink.parquet import ordered_map

    started, lock = [], threading.Lock()

    def fn(i):
        with lock:
            started.append(i)
        time.sleep(random.random() / 500)
        if i == 37:
            raise ValueError("item 37")
        return i * i

    got = []
    with pytest.raises(ValueError, match="item 37"):
        for k, v in enumerate(ordered_map(fn, range(100), threads=4)):
            with lock:
                assert len(started) <= k + 1 + 2 * 4  # the window, not the whole input
            got.append(v)
    assert got == [i * i for i in range(37)]


@pytest.mark.slow
def test_seal_reads_many_staged_files_in_parallel_and_commits_each_row_once(tmp_path):
    """The end of a run publishes hundreds of staged batches (read `READ_THREADS` at a time):
    every row once, in the rolled parts, none of the already-committed ones again."""
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    ids = [f"r{i:05d}" for i in range(3000)]
    sink.commit(_rows(ids[:100]))  # published before the end; also left staged below (a writer died)
    for k in range(0, 3000, 10):
        sink.stage(_rows(ids[k:k + 10]), f"w-{k % 3}")
    sink.seal(target_rows=700)
    rows = sink.read()
    assert rows.column("id").to_pylist() == ids
    assert len(sink.parts()) == 1 + 5  # the first part, then 2900 rows rolled at 700


def test_scan_calls_take_256_media_unless_set_or_the_rows_embed_bytes(tmp_path):
    """`scan_batch_size`: 256 media per scan call for URI manifests; the config's
    `resources.preprocess.batch_size` when given; and when the manifest embeds the bytes."""
    import pyarrow.parquet as pq

    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.plan.spec import SCAN_BATCH_SIZE, scan_batch_size
    from vlbatch.pipeline.sources import open_source

    pq.write_table(pa.table({"media_uri": ["a.png", "b.png"]}), tmp_path / "uris.parquet")
    pq.write_table(pa.table({"media_uri": pa.array([b"\x89PNG", b"\x89PNG"], pa.binary())}), tmp_path / "bytes.parquet")

    def cfg(name, **pre):
        return JobConfig.model_validate({"model": {"path": "m"}, "input": {"uri": str(tmp_path / name)},
                                         "output": {"uri": str(tmp_path / "o")}, "task": {"mode": "scan"},
                                         "resources": {"preprocess": pre}})

    for c, want in ((cfg("uris.parquet"), SCAN_BATCH_SIZE), (cfg("uris.parquet", batch_size=32), 32),
                    (cfg("bytes.parquet"), 8), (cfg("bytes.parquet", num_cpus=0.5), 8)):
        assert scan_batch_size(c, open_source(c)) == want
    assert SCAN_BATCH_SIZE == 256
