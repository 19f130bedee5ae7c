"""The output sink contract (`vlbatch.operators.sink.base`), checked on every sink class.

Every sink registered in `operators/sink.SINKS` is checked, as it is. The crash test runs the commit in a child
process and SIGKILLs it from a `sys.addaudithook` hook at each filesystem mutation the commit
makes (directory creation, a file opened for writing, rename, delete) and after each write
call to a real file (bytes partly written): whatever the point,
the batch must afterwards be invisible or entirely visible, never partly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pyarrow as pa
import pytest

from vlbatch.operators.sink import SINKS as REGISTERED
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA, OutputRow, Timings, rows_to_table

SINKS = [REGISTERED.load(name) for name in REGISTERED.choices()]  # every `output.format` the config accepts


def _rows(ids: range, *, answer: str = "a cat", error_type: str | None = None) -> pa.Table:
    ok = error_type is None
    return rows_to_table([
        OutputRow(id=f"id{i:03d}", request_index=0, media_uri=f"/m/{i}.jpg", media_type="image", prompt="Describe.",
                  status="ok" if ok else "error", model="tiny", run_id="r", answer=answer if ok else None,
                  error_type=error_type, error_message=None if ok else "boom", prompt_tokens=10 if ok else None,
                  visual_tokens=4, timings=Timings(0.1, 0.2, 0.3)) for i in ids])


def _ids(sink) -> list[str]:
    return sink.read().column("id").to_pylist()


@pytest.fixture(params=SINKS, ids=lambda c: c.__name__)
def sink_cls(request):
    return request.param


def test_commit_index_and_read(sink_cls, tmp_path):
    sink = sink_cls(str(tmp_path / "run"))
    sink.prepare()
    assert sink.index().files == () and sink.read().num_rows == 0 and sink.read_summary() is None
    assert sink.commit(_rows(range(0, 0))) is None
    a = sink.commit(_rows(range(0, 3)))
    sink.commit(_rows(range(3, 5), error_type="MediaError"))  # permanent: done
    sink.commit(_rows(range(5, 7), error_type="EngineError"))  # transient: redone on resume
    sink.write_summary('{"done": true}')  # beside the output, never a commit
    assert sink.read_summary() == '{"done": true}'  # what the next run's summary keeps attempts from
    idx = sink.index()
    assert len(idx.files) == 3 and a in idx.files
    assert idx.done_ids == {f"id{i:03d}" for i in range(5)} and idx.transient_ids == {"id005", "id006"}
    assert idx.status_counts == {"ok": 3, "error": 4} and idx.duplicate_ids == 0
    got = sink.read()
    assert got.schema.equals(OUTPUT_SCHEMA) and _ids(sink) == [f"id{i:03d}" for i in range(7)]
    # the same ids again (a retried batch, rows in another order): replaced, never a second copy
    assert sink.commit(_rows(range(2, -1, -1), answer="a dog")) == a
    again = sink.index()
    assert again.files == idx.files and again.duplicate_ids == 0 and sum(again.status_counts.values()) == 7
    assert {r["answer"] for r in sink.read().to_pylist() if r["status"] == "ok"} == {"a dog"}
    # another instance over the same location sees the same commits
    assert sink_cls(sink.uri).index() == again


def test_purge_removes_only_the_transient_rows_of_the_ids(sink_cls, tmp_path):
    sink = sink_cls(str(tmp_path / "run"))
    sink.prepare()
    mixed = pa.concat_tables([_rows(range(0, 2)), _rows(range(2, 4), error_type="StorageError"),
                              _rows(range(4, 5), error_type="InputError")])
    sink.commit(mixed)
    sink.commit(_rows(range(5, 7), error_type="MediaTimeoutError"))
    assert sink.purge([]) == 0 and len(_ids(sink)) == 7
    assert sink.purge({"id000", "id002", "id004", "id005"}) == 2  # ok / permanent rows of listed ids stay
    idx = sink.index()
    assert _ids(sink) == ["id000", "id001", "id003", "id004", "id006"]
    assert idx.transient_ids == {"id003", "id006"} and idx.duplicate_ids == 0
    assert sink.purge(idx.purgeable_ids) == 2
    assert _ids(sink) == ["id000", "id001", "id004"] and sink.index().transient_ids == frozenset()
    kept = {r["id"]: r for r in sink.read().to_pylist()}
    assert kept == {r["id"]: r for r in mixed.to_pylist() if r["id"] in kept}  # untouched rows


CHILD = r"""
import importlib, io, os, signal, sys, threading
import pyarrow as pa
module, name = sys.argv[1].split(":")
sink = getattr(importlib.import_module(module), name)(sys.argv[2])
table = pa.ipc.open_file(sys.argv[3]).read_all()
kill_at, seen = int(sys.argv[4]), []
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
MUTATIONS = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree")

def point(what):
    seen.append(what)
    if len(seen) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def audit(event, args):  # just before a mutation
    if event == "open":
        mode, flags = args[1], args[2]
        if any(c in mode for c in "wax+") if isinstance(mode, str) else flags & WRITE_FLAGS:
            point(event)
    elif event in MUTATIONS:
        point(event)

def profile(frame, event, arg):  # just after bytes went to a real file (partly written)
    if event == "c_return" and getattr(arg, "__name__", "") in ("write", "writelines", "flush"):
        f = getattr(arg, "__self__", None)
        if isinstance(f, io.IOBase) and not isinstance(f, io.BytesIO) and f not in (sys.stdout, sys.stderr):
            point(arg.__name__)

sys.addaudithook(audit)
threading.setprofile(profile)
sys.setprofile(profile)
sink.commit(table)
sys.setprofile(None)
sys.stdout.write(f"{len(seen)} {' '.join(seen)}\n")
"""


def _commit_in_child(sink_cls, uri: str, table: pa.Table, path, kill_at: int) -> subprocess.CompletedProcess:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", CHILD, f"{sink_cls.__module__}:{sink_cls.__qualname__}", uri,
                           str(path), str(kill_at)], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("replace", [False, True], ids=["new", "replace"])
def test_a_crash_mid_commit_leaves_nothing_or_the_whole_batch(sink_cls, tmp_path, replace):
    before = _rows(range(5), answer="old")  # with `replace`: already committed, the batch recommits its ids
    batch = _rows(range(5), answer="new")

    def start(name: str) -> str:
        uri = str(tmp_path / name)
        sink = sink_cls(uri)
        sink.prepare()
        if replace:
            sink.commit(before)
        return uri

    full = _commit_in_child(sink_cls, start("run0"), batch, tmp_path / "batch.arrow", kill_at=0)
    assert full.returncode == 0, full.stderr
    n = int(full.stdout.split()[0])
    assert n >= 1  # the commit mutates storage, so there are crash points to test
    for k in range(1, n + 1):
        uri = start(f"run{k}")
        crashed = _commit_in_child(sink_cls, uri, batch, tmp_path / "batch.arrow", kill_at=k)
        assert crashed.returncode == -signal.SIGKILL, (k, crashed.stdout, crashed.stderr)
        after = sink_cls(uri)
        visible = after.read()
        assert visible.equals(before if replace else before.slice(0, 0)) or visible.equals(batch), k
        idx = after.index()
        assert idx.duplicate_ids == 0 and sum(idx.status_counts.values()) == visible.num_rows
        after.prepare()  # the next run: debris gone, and the batch commits whole
        after.commit(batch)
        assert after.read().equals(batch) and after.index().duplicate_ids == 0
