"""Issue 48 item 7, follow-up: a WebDataset shard over http(s) that trickles must not hold its read task.

A real loopback HTTP server (threading) serves a good shard (with its Content-Length) and a shard
that sends its first sample and part of the second's first member at once, then the rest of its
real tar bytes one per second, with no Content-Length. The shard reader (`read_shard`, the block
function's per-shard step, called directly: no Ray) must end the trickling shard as today's
contract for a shard cut mid-stream says (the samples read before stay; the sample being read
becomes an error row; nothing of the rest), that row a `StorageError` (transient: retried on
resume), and the good shard's rows all there. On the old code the read blocks for hours: the
`timeout` marker makes that a failure, not a hung suite.
"""
from __future__ import annotations

import io
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vlbatch.operators.errors import StorageError
from vlbatch.operators.storage import StorageOptions
from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.sources.webdataset import read_shard


def _png(i: int) -> bytes:
    """A noise image (about 48 KiB: it spans several 10 KiB tar records), the same for one `i`."""
    import random

    from PIL import Image

    buf = io.BytesIO()
    Image.frombytes("RGB", (128, 128), random.Random(i).randbytes(128 * 128 * 3)).save(buf, format="PNG")
    return buf.getvalue()


def _tar(first: int, n: int) -> bytes:
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as w:
        for i in range(first, first + n):
            w.write({"__key__": f"sample{i:04d}", "png": _png(i), "txt": f"caption {i}"})
    return buf.getvalue()


def _cut_inside_second_sample(tar: bytes) -> int:
    """An offset inside the second sample's first member, two tar records (10 KiB each) past its
    header (tarfile's stream mode reads ahead up to a record): the first sample is then whole and
    the reader has seen the second one's key (so the first is yielded) before the trickle starts."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        second = next(m for m in t.getmembers() if m.isfile() and m.name.startswith("sample0011"))
    cut = second.offset_data + 2 * tarfile.RECORDSIZE
    assert second.offset_data < cut < second.offset_data + second.size  # the test's own shard
    return cut


class _Shards(BaseHTTPRequestHandler):
    """/good.tar: a whole shard with its Content-Length; /trickle.tar: the head of a shard at once,
    then its remaining bytes one a second (no Content-Length) until the test ends."""

    stop: threading.Event
    good: bytes
    slow: bytes
    cut: int

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        try:
            if self.path == "/good.tar":
                self.send_response(200)
                self.send_header("Content-Length", str(len(self.good)))
                self.end_headers()
                self.wfile.write(self.good)
                return
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(self.slow[:self.cut])
            self.wfile.flush()
            for i in range(self.cut, len(self.slow)):
                if self.stop.wait(1.0):
                    return
                self.wfile.write(self.slow[i:i + 1])
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up: what the fix does


@pytest.fixture
def shards():
    stop = threading.Event()
    slow = _tar(10, 3)
    handler = type("Handler", (_Shards,), {"stop": stop, "good": _tar(0, 3), "slow": slow,
                                           "cut": _cut_inside_second_sample(slow)})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    stop.set()  # the handlers end their trickle, whatever the test did
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trickling_http_shard_ends_with_a_storage_error_row_and_the_good_shard_is_whole(shards, tmp_path):
    from vlbatch.pipeline.sources.base import COLUMNS
    from vlbatch.pipeline.stages.requests import expand_all

    # small, test-chosen limits: the trickle (1 B/s) is far under 200 B/s over each 0.5 s window;
    # read_timeout_s is longer than a byte's wait, so only the rate rule can end the stream
    storage = StorageOptions(max_attempts=1, read_timeout_s=30, http_min_bytes_per_s=200, http_rate_window_s=0.5)
    good = list(read_shard(f"{shards}/good.tar", storage))
    slow = list(read_shard(f"{shards}/trickle.tar", storage))

    assert [r["identity"] for r in good] == ["sample0000", "sample0001", "sample0002"]
    assert all(r.get("error") is None and r["media_bytes"] == _png(i) for i, r in enumerate(good))

    # the sample read before the trickle stays; the sample being read is the error row; no more
    assert [r["identity"] for r in slow] == ["sample0010", "sample0011"]
    assert slow[0].get("error") is None and slow[0]["media_bytes"] == _png(10)
    assert slow[1].get("media_bytes") is None and "http_min_bytes_per_s" in slow[1]["error"]

    # at expansion the cut sample is a StorageError (transient: retried on resume), not bad input
    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}})
    rows = [{c: r.get(c) for c in COLUMNS} for r in good + slow]
    tasks, _ = expand_all([tuple(r[c] for c in COLUMNS) for r in rows], cfg.task)
    assert [t.status for t in tasks] == ["ok"] * 4 + ["error"]
    failed = tasks[-1]
    assert failed.error_type == "StorageError", failed.error_message
    assert not StorageError.permanent and "\n" not in failed.error_message
    assert "trickle.tar" in failed.error_message and "http_min_bytes_per_s=200" in failed.error_message


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_shard_whose_headers_trickle_is_a_storage_error_row(tmp_path):
    """The opening of a stream has the headers deadline (`http_total_timeout_s`), as `read_http`:
    after the last attempt the whole shard is one StorageError row, never a failed read task."""
    import socket

    stop = threading.Event()
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not stop.wait(0.2):
                try:
                    conn.sendall(b"a")
                except OSError:
                    return

    threading.Thread(target=serve, daemon=True).start()
    try:
        storage = StorageOptions(max_attempts=1, read_timeout_s=30, http_total_timeout_s=1)
        shard = f"http://127.0.0.1:{srv.getsockname()[1]}/s.tar"
        (row,) = list(read_shard(shard, storage))
    finally:
        stop.set()
        srv.close()
    assert row["media_uri"] == shard and row.get("identity") is None
    assert "no response headers within 1 s" in row["error"]
    from vlbatch.pipeline.sources.base import COLUMNS
    from vlbatch.pipeline.stages.requests import expand_all

    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}})
    (task,), _ = expand_all([tuple({"media_uri": shard, **row}.get(c) for c in COLUMNS)], cfg.task)
    assert task.error_type == "StorageError", task.error_message


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_paused_reader_is_not_a_slow_server(shards):
    """Only time spent waiting on the server counts towards a window: a reader that stops reading
    (Ray holding a block back) for many windows still gets the whole body."""
    import time

    from vlbatch.operators.storage.http_stream import open_http

    storage = StorageOptions(max_attempts=1, read_timeout_s=30, http_min_bytes_per_s=1, http_rate_window_s=0.2)
    with open_http(f"{shards}/good.tar", storage) as f:
        head = f.read(512)
        time.sleep(1.0)  # a pause of five windows with nothing read: wall-clock windows would see 0 B/s
        body = head + f.read()
    with tarfile.open(fileobj=io.BytesIO(body)) as t:  # the whole shard (its mtimes are the server's own)
        pngs = [t.extractfile(m).read() for m in t.getmembers() if m.name.endswith(".png")]
    assert pngs == [_png(i) for i in range(3)]
