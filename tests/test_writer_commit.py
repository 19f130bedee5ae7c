"""Writer: one fixed schema, deterministic atomic commits, resume index, local and S3 (moto server)."""
from __future__ import annotations

import errno
import os
import socket
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlbatch.operators.errors import StorageError
from vlbatch.operators.sink.base import is_transient
from vlbatch.operators.sink.parquet import ParquetSink, part_name
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA, OutputRow, Timings, rows_to_table, table_to_rows
from vlbatch.operators.storage import StorageOptions, with_retries

FAST = StorageOptions(backoff_s=0.001, backoff_max_s=0.01)


def _row(i: int, status="ok", error_type=None) -> OutputRow:
    ok = status == "ok"
    return OutputRow(id=f"id{i:03d}", request_index=i % 3, media_uri=f"s3://b/m{i}.jpg", media_type="image",
                     prompt="Describe.", status=status, model="tiny", run_id="r", answer="a cat" if ok else None,
                     error_type=error_type, error_message=None if ok else "boom",
                     prompt_tokens=10 if ok else None, visual_tokens=4, generated_tokens=3 if ok else None,
                     finish_reason="stop" if ok else None, timings=Timings(0.1, 0.2, 0.3 if ok else None))


def test_ok_and_error_rows_share_one_schema_and_round_trip():
    rows = [_row(0), _row(1, "error", "MediaError")]
    t = rows_to_table(rows)
    assert t.schema.equals(OUTPUT_SCHEMA)
    assert rows_to_table([rows[1]]).schema.equals(rows_to_table([rows[0]]).schema)
    assert table_to_rows(t) == rows
    assert OUTPUT_SCHEMA.names == ["id", "request_index", "media_uri", "media_type", "prompt", "prompt_name",
                                   "answer", "parsed", "thinking",
                                   "status", "error_type", "error_message", "prompt_tokens", "visual_tokens",
                                   "generated_tokens", "finish_reason", "quality_flags", "model", "run_id", "timings",
                                   "clip_index", "clip_start_s", "clip_end_s", "clip_source", "clip_uri", "clip_last"]


def test_part_names_are_deterministic_and_order_free():
    assert part_name(["b", "a"]) == part_name(["a", "b"]) != part_name(["a", "c"])


def test_commit_is_idempotent_and_leaves_no_temp(tmp_path):
    sink = ParquetSink(str(tmp_path / "out"))
    sink.prepare()
    t = rows_to_table([_row(i) for i in range(5)])
    p1 = sink.commit(t)
    p2 = sink.commit(t.take([4, 3, 2, 1, 0]))  # a retried write of the same rows
    assert p1 == p2 and sink.parts() == [p1]
    assert not os.listdir(tmp_path / "out" / "_tmp")
    assert pq.read_table(p1).schema.equals(OUTPUT_SCHEMA)
    assert sink.commit(t.slice(0, 0)) is None


def test_killed_writer_temp_files_are_never_committed(tmp_path):
    sink = ParquetSink(str(tmp_path))
    os.makedirs(tmp_path / "_tmp")
    debris = "part-" + "a" * 24 + ".parquet." + "1" * 32 + ".vlbatch-tmp"  # put_atomic's marked temp name
    (tmp_path / "_tmp" / debris).write_bytes(b"PAR1 half a file")
    sink.commit(rows_to_table([_row(1)]))
    assert len(sink.index().files) == 1
    sink.prepare()
    assert not (tmp_path / "_tmp").exists()


def test_transient_classification():
    assert not is_transient("MediaError") and not is_transient("InputError")
    assert is_transient("StorageError") and is_transient("MediaTimeoutError") and is_transient("EngineError")
    assert is_transient("RuntimeError")  # unknown exceptions (bugs, OOM) are retried
    assert not is_transient(None)


def test_index_and_purge_keep_permanent_and_redo_transient(tmp_path):
    sink = ParquetSink(str(tmp_path))
    a = [_row(0), _row(1, "error", "MediaError"), _row(2, "error", "StorageError")]
    b = [_row(3), _row(4, "error", "EngineError")]
    fa = sink.commit(rows_to_table(a))
    sink.commit(rows_to_table(b))
    idx = sink.index()
    assert idx.done_ids == {"id000", "id001", "id003"} and idx.transient_ids == {"id002", "id004"}
    assert idx.status_counts == {"ok": 2, "error": 3} and idx.duplicate_ids == 0
    # a crash in the middle of a purge: the new file is committed, the old one still there
    sink.commit(rows_to_table(a[:2]))
    crashed = sink.index()
    assert crashed.duplicate_ids == 2 and fa in crashed.files and crashed.purgeable_ids == {"id002", "id004"}
    assert sink.purge(crashed.purgeable_ids) == 2
    after = sink.index()
    assert after.duplicate_ids == 0 and after.purgeable_ids == frozenset() and after.transient_ids == frozenset()
    assert fa not in after.files
    assert sorted(sink.read().column("id").to_pylist()) == ["id000", "id001", "id003"]


def test_purge_drops_a_stray_transient_row_beside_an_ok_row_of_the_same_id(tmp_path):
    sink = ParquetSink(str(tmp_path))
    sink.commit(rows_to_table([_row(0), _row(1)]))
    sink.commit(rows_to_table([_row(1, "error", "EngineError"), _row(2, "error", "MediaError")]))
    idx = sink.index()
    assert idx.done_ids == {"id000", "id001", "id002"} and idx.transient_ids == frozenset()
    assert idx.purgeable_ids == {"id001"} and idx.duplicate_ids == 1
    assert sink.purge(idx.purgeable_ids) == 1
    after = sink.index()
    assert after.duplicate_ids == 0 and after.status_counts == {"ok": 2, "error": 1}


def test_retries_then_typed_storage_error():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    assert with_retries(flaky, what="x", storage=StorageOptions(max_attempts=4, backoff_s=0.001)) == "ok"
    assert len(calls) == 3
    with pytest.raises(StorageError, match="failed after 2 attempts"):
        with_retries(lambda: (_ for _ in ()).throw(OSError(errno.ECONNRESET, "down")), what="x",
                     storage=StorageOptions(max_attempts=2, backoff_s=0.001))
    for permanent in (ValueError("bug"), FileNotFoundError("gone")):  # not retried, not wrapped
        calls.clear()

        def fail(e=permanent):
            calls.append(1)
            raise e

        with pytest.raises(type(permanent)):
            with_retries(fail, what="x", storage=FAST)
        assert len(calls) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto():
    """A moto S3 server on loopback (its state lives in this process, so stop/start keeps objects)."""
    from moto.server import ThreadedMotoServer

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield server, f"http://127.0.0.1:{port}"
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.slow
def test_s3_commit_index_and_outage(moto):
    server, endpoint = moto
    sink = ParquetSink("s3://out-bucket/run1", StorageOptions(endpoint_url=endpoint, region="us-east-1",
                                                              max_attempts=2))
    fs = sink.fs
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="out-bucket")
    t = rows_to_table([_row(i) for i in range(4)] + [_row(9, "error", "StorageError")])
    path = sink.commit(t)
    assert path == f"out-bucket/run1/{part_name(t.column('id').to_pylist())}"
    assert not fs.exists("out-bucket/run1/_tmp")  # S3: one PUT straight to the final key
    assert sink.index().transient_ids == {"id009"}
    # the server goes away during a commit and comes back: the backoff absorbs it
    server.stop()
    restarted = threading.Event()

    def restart():
        threading.Event().wait(1.5)  # the outage itself (what is being tested), not a synchronisation
        server.start()
        restarted.set()

    threading.Thread(target=restart, daemon=True).start()
    # the outage outlasts a short policy: 8 attempts, backoff 0.5 s doubling (full jitter), capped at 10 s
    patient = ParquetSink(sink.uri, StorageOptions(endpoint_url=endpoint, region="us-east-1", max_attempts=8,
                                                   backoff_s=0.5))
    p2 = patient.commit(rows_to_table([_row(20)]))
    assert restarted.is_set() and fs.exists(p2)
    got = sink.read()
    assert got.num_rows == 6 and got.schema.equals(OUTPUT_SCHEMA)
    assert isinstance(got.column("timings").type, pa.StructType)
