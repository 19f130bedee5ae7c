"""Reading media through fsspec: local paths and a real S3 API (moto server on loopback) via s3fs.

Transient failures are injected by `FlakyProxy`, a TCP proxy between s3fs and moto
that answers the first N connections with a real HTTP 503 SlowDown (or resets them)
and forwards the rest byte for byte. Why a proxy: moto has no fault injection, and
stopping/restarting the server would need timing; the proxy fails exactly N
requests, deterministically, on the real network path (aiohttp, botocore, s3fs).
"""
from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from vlbatch.devtools.samples import encode_video, frame_index
from vlbatch.operators.errors import ConfigError, MediaError, StorageError
from vlbatch.operators.media.load import load_media
from vlbatch.operators.media.worker import DecodeWorker
from vlbatch.operators.storage import StorageOptions, classify, read_bytes
from vlbatch.operators.types import VideoClip

SLOW_DOWN = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")


class FlakyProxy:
    """127.0.0.1 proxy to `upstream`; the first `failures` connections fail with `mode` ('503' or 'reset')."""

    def __init__(self, upstream: str, failures: int, mode: str = "503"):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.failures, self.mode = failures, mode
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.connections += 1
            if self.connections <= self.failures:
                self._fail(conn)
            else:
                up = socket.create_connection(self.upstream)
                for a, b in ((conn, up), (up, conn)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _fail(self, conn: socket.socket) -> None:
        with conn:
            if self.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                return  # RST on close
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            body = b"" if head.startswith(b"HEAD ") else SLOW_DOWN  # a HEAD response has no body
            conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                         + f"Content-Length: {len(SLOW_DOWN)}\r\n\r\n".encode() + body)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def bucket(s3_server):
    """A bucket with a JPEG, a video and a video without extension; yields (server, name, bytes by key)."""
    from PIL import Image

    from vlbatch.devtools.sample_images import gradient

    name = "media-io-test"
    client = s3_server.client()
    client.create_bucket(Bucket=name)
    import io
    import tempfile

    buf = io.BytesIO()
    Image.fromarray(gradient(64, 40)).save(buf, format="JPEG")
    with tempfile.TemporaryDirectory() as d:
        encode_video(Path(d) / "v.mp4", 15, 64, 48, 15, options={"bf": "2"})
        video = (Path(d) / "v.mp4").read_bytes()
    objects = {"img/a.jpg": buf.getvalue(), "vid/b.mp4": video, "vid/noext": video}
    for key, data in objects.items():
        client.put_object(Bucket=name, Key=key, Body=data)
    return s3_server, name, objects


def options(url: str, **kw) -> StorageOptions:
    return StorageOptions(endpoint_url=url, region="us-east-1", backoff_s=0.01, backoff_max_s=0.05, **kw)


def test_local_paths(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"abc")
    assert read_bytes(str(p)) == b"abc"
    assert read_bytes(f"file://{p}") == b"abc"
    with pytest.raises(MediaError, match="FileNotFoundError"):
        read_bytes(str(tmp_path / "missing.mp4"))
    with pytest.raises(ConfigError, match="unsupported storage scheme"):
        read_bytes("ftp://host/x.mp4")


def test_s3_read_through_s3fs(bucket):
    server, name, objects = bucket
    assert read_bytes(f"s3://{name}/vid/b.mp4", options(server.endpoint_url)) == objects["vid/b.mp4"]


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_transient_failures_are_absorbed_by_retries(bucket, mode, caplog):
    server, name, objects = bucket
    proxy = FlakyProxy(server.endpoint_url, failures=2, mode=mode)
    try:
        with caplog.at_level(logging.WARNING, logger="vlbatch.operators.storage.retry"):
            data = read_bytes(f"s3://{name}/img/a.jpg", options(proxy.url, max_attempts=4))
    finally:
        proxy.close()
    assert data == objects["img/a.jpg"]
    # each injected 503 reached our loop (no hidden botocore/s3fs retries), then one attempt got through;
    # a reset before the request is sent may also be re-dialled once by aiohttp itself, so >= 1 there
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 if mode == "503" else 1 <= len(retries) <= 2
    assert proxy.connections >= 3
    assert all(server.secret_key not in r.getMessage() and server.access_key not in r.getMessage()
               for r in caplog.records)


def test_storage_error_after_the_last_attempt(bucket):
    server, name, _ = bucket
    proxy = FlakyProxy(server.endpoint_url, failures=100)
    try:
        with pytest.raises(StorageError, match="after 3 attempts") as e:
            read_bytes(f"s3://{name}/img/a.jpg", options(proxy.url, max_attempts=3))
    finally:
        proxy.close()
    assert proxy.connections == 3
    assert not e.value.permanent


def test_missing_object_is_permanent_and_not_retried(bucket, caplog):
    server, name, _ = bucket
    with caplog.at_level(logging.WARNING, logger="vlbatch.operators.storage.retry"):
        with pytest.raises(MediaError, match="cannot read") as e:
            read_bytes(f"s3://{name}/nope.mp4", options(server.endpoint_url, max_attempts=5))
    assert e.value.permanent
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_classify():
    assert classify(FileNotFoundError("x")) == "permanent"
    assert classify(ConnectionResetError()) == "transient"
    assert classify(OSError(16, "SlowDown")) == "transient"
    assert classify(ValueError("bad bucket name")) == "unknown"


@pytest.fixture(scope="module")
def worker():
    with DecodeWorker(timeout_s=30) as w:
        yield w


def test_load_media_images_and_videos_from_s3(bucket, worker):
    server, name, _ = bucket
    opts = options(server.endpoint_url)
    img = load_media(f"s3://{name}/img/a.jpg", opts)
    assert isinstance(img, np.ndarray) and img.shape == (40, 64, 3) and img.dtype == np.uint8
    for key in ("vid/b.mp4", "vid/noext"):  # the second is recognised by its bytes
        clip = load_media(f"s3://{name}/{key}", opts, worker=worker)
        assert isinstance(clip, VideoClip) and clip.total_frames == 15 and clip.source_fps == 15.0
        assert [frame_index(f) for f in clip.frames] == list(clip.indices)
    with pytest.raises(MediaError):
        load_media(f"s3://{name}/img/missing.png", opts)


def test_load_media_bad_bytes_are_media_errors(tmp_path, worker):
    for name, data in {"a.png": b"", "b.jpg": b"\xff\xd8\xff" + b"\x00" * 50, "c.mp4": b"nope" * 10,
                       "d": b"\x00" * 64}.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(MediaError):
            load_media(str(tmp_path / name), worker=worker)


def test_open_input_reads_like_a_file(tmp_path):
    from vlbatch.operators.storage import filesystem, open_input

    data = bytes(range(256)) * 301  # 77056 bytes
    (tmp_path / "m.bin").write_bytes(data)
    fs, path = filesystem(str(tmp_path / "m.bin"))
    with open_input(fs, path) as f:
        assert f.read(7) == data[:7] and f.tell() == 7
        f.seek(-13, 2)
        assert f.read() == data[-13:] and f.read(5) == b""
        f.seek(40001)
        assert f.read(30000) == data[40001:70001]
        f.seek(0)
        assert f.read() == data


@pytest.mark.slow
def test_manifest_reads_through_arrow_retry_transient_failures(bucket, caplog):
    """Ray Data reads manifests through `arrow_filesystem`: its calls follow the same retry policy."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlbatch.operators.storage import arrow_filesystem, filesystem

    server, name, _ = bucket
    table = pa.table({"media_uri": [f"m{i}.jpg" for i in range(500)], "n": list(range(500))})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    server.client().put_object(Bucket=name, Key="manifest/m.parquet", Body=buf.getvalue())
    proxy = FlakyProxy(server.endpoint_url, failures=3)
    try:
        opts = options(proxy.url, max_attempts=5)
        fs, path = filesystem(f"s3://{name}/manifest/m.parquet", opts)
        with caplog.at_level(logging.WARNING, logger="vlbatch.operators.storage.retry"):
            got = pq.read_table(path, filesystem=arrow_filesystem(fs, opts))
    finally:
        proxy.close()
    assert got.equals(table)
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 3


def test_extension_is_pathlibs_suffix_of_the_uri_path():
    """`extension` reimplements `PurePosixPath(path).suffix.lower()` for speed: same answer on
    every shape of name (dot files, trailing dots and slashes, "." segments, queries)."""
    from pathlib import PurePosixPath

    from vlbatch.operators.media.load import extension

    cases = ["a/b.PNG", "s3://bucket/x.tar.gz", "http://h/p.jpg?x=1.png", ".bashrc", "a.", "noext", "dir.d/file",
             "x.png/", "", "/", "a/.hidden", "a/..", "a/b..c", "file:///x/y.MP4", "a//b.jpg", "..", "x/.", "a.b/.",
             "a.b/./", "v.MKV?", "?q.png"]
    for c in cases:
        assert extension(c) == PurePosixPath(c.split("?", 1)[0]).suffix.lower(), c
