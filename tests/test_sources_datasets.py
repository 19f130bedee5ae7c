"""Real dataset layouts, written by the real tools (not by our code): WebDataset shards
(`webdataset.TarWriter`), Hugging Face `datasets` Parquet (Image / Video features), media on
a threaded HTTP server on loopback with faults, and a checkpoint on a moto S3 server."""
from __future__ import annotations

import io
import json
import multiprocessing as mp
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from vlbatch.operators.errors import InputError, MediaError, StorageError
from vlbatch.operators.storage import StorageOptions, read_bytes
from vlbatch.operators.storage.http import HostLimiter
from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.sources import keep as keep_cols
from vlbatch.pipeline.sources.webdataset import expand_braces, read_shard, split_name
from vlbatch.pipeline.stages.requests import expand


def _png(seed: int, size=(40, 56)) -> bytes:
    img = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _cfg(tmp_path, **inp) -> object:
    return validate_config({"model": {"path": str(tmp_path)}, "input": {"uri": str(tmp_path), **inp},
                            "output": {"uri": str(tmp_path / "out")}})


def write_shard(path: Path, n: int, first: int = 0) -> list[bytes]:
    """Samples `sample<first>`.. (keys unique across shards, as WebDataset datasets have them)."""
    import webdataset as wds

    images = [_png(i) for i in range(first, first + n)]
    with wds.TarWriter(str(path)) as w:
        for i, png in enumerate(images, start=first):
            w.write({"__key__": f"sample{i:04d}", "png": png, "txt": f"caption {i}", "json": {"i": i}})
        w.write({"__key__": f"nomedia{first}", "txt": "only text"})
    return images


# --- WebDataset ---------------------------------------------------------------------------

def test_brace_notation_and_member_names():
    assert expand_braces("s/train-{000..002}.tar") == ["s/train-000.tar", "s/train-001.tar", "s/train-002.tar"]
    assert expand_braces("{a,b}-{8..10}") == ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
    assert split_name("dir/0001.seg.jpg") == ("dir/0001", "seg.jpg")
    assert split_name("x.PNG") == ("x", "png")


def test_webdataset_shard_written_by_webdataset(tmp_path):
    shard = tmp_path / "train-000000.tar"
    images = write_shard(shard, 3)
    rows = list(read_shard(str(shard), StorageOptions(), keep=("txt", "json")))
    assert [r.get("identity") for r in rows] == ["sample0000", "sample0001", "sample0002", "nomedia0"]
    assert [r["media_uri"] for r in rows[:3]] == [f"{shard}#sample{i:04d}.png" for i in range(3)]
    assert [r["media_bytes"] for r in rows[:3]] == images
    assert rows[1]["kept"]["txt"] == "caption 1" and json.loads(rows[1]["kept"]["json"]) == {"i": 1}
    assert rows[0]["media_type"] == "image" and "error" not in rows[0]
    assert "no image or video member" in rows[3]["error"]
    # ids hash the key: the same sample in a moved shard keeps its request ids
    task = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": "o"}}).task
    a = expand(rows[0]["media_uri"], "image", None, task, rows[0]["media_bytes"], "sample0000")
    b = expand("/elsewhere/t.tar#sample0000.png", "image", None, task, rows[0]["media_bytes"], "sample0000")
    assert a.ids == b.ids and a.media_bytes == images[0]


def test_truncated_shard_gives_error_rows_not_a_failure(tmp_path):
    shard = tmp_path / "full.tar"
    write_shard(shard, 4)
    data = shard.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: len(data) // 2])
    rows = list(read_shard(str(cut), StorageOptions()))
    ok = [r for r in rows if "error" not in r]
    bad = [r for r in rows if "error" in r]
    assert len(bad) == 1 and "truncated or corrupt" in bad[0]["error"]
    assert 1 <= len(ok) < 4
    assert all(r["media_bytes"] == _png(i) for i, r in enumerate(ok))
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"\x01" * 1000)
    rows = list(read_shard(str(garbage), StorageOptions()))
    assert len(rows) == 1 and rows[0]["media_uri"] == str(garbage) and rows[0]["error"]
    row = expand(rows[0]["media_uri"], None, None, _cfg(tmp_path).task, None, None, rows[0]["error"])
    assert row.status == "error" and row.error_type == "InputError"


# --- Hugging Face datasets Parquet ----------------------------------------------------------

def _read_parquet(cfg, path: str, keep=None) -> pa.Table:
    from vlbatch.pipeline.sources.manifest import _read_parquet_files

    return pa.concat_tables(_read_parquet_files(pa.table({"path": [path]}), cfg=cfg, base_uri=str(Path(path).parent),
                                                keep=keep))


def test_parquet_written_by_hf_datasets_image_feature(tmp_path):
    from datasets import Dataset
    from datasets import Image as HFImage

    pil = [Image.open(io.BytesIO(_png(i))) for i in range(3)]
    ds = Dataset.from_dict({"image": pil, "caption": ["a", "b", "c"], "score": [0.5, 1.5, 2.5],
                            "tags": [["x"], [], ["y", "z"]]}).cast_column("image", HFImage())
    path = str(tmp_path / "train.parquet")
    ds.to_parquet(path)
    cfg = _cfg(tmp_path, format="parquet", columns={"media": "image", "keep": ["caption", "score", "tags"]})
    from vlbatch.pipeline.sources.manifest import ManifestSource

    kept = ManifestSource(cfg).keep_schema()
    assert kept.field("score").type == pa.float64() and kept.field("tags").type == pa.list_(pa.string())
    t = _read_parquet(cfg, path, kept)
    assert t.column("media_uri").to_pylist() == [f"{path}#{i}" for i in range(3)]  # no path in the export
    assert t.column("media_type").to_pylist() == ["image"] * 3  # from the PNG signature
    for i, b in enumerate(t.column("media_bytes").to_pylist()):
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(b))), np.asarray(pil[i]))
    back = keep_cols.decode(t.column("keep").to_pylist(), [2, 0, 1], kept)
    assert back.to_pylist() == [{"caption": "a", "score": 0.5, "tags": ["x"]}] * 2 + \
        [{"caption": "c", "score": 2.5, "tags": ["y", "z"]}]
    assert back.schema == kept


def test_parquet_written_by_hf_datasets_video_feature_keeps_the_path(tmp_path):
    import datasets

    if not hasattr(datasets, "Video"):
        pytest.skip("this datasets has no Video feature")
    from vlbatch.devtools.samples import write_all

    vids = [v["path"] for v in write_all(tmp_path / "media")["videos"] if not v["bad"]][:2]
    table = pa.table({"video": pa.array([{"bytes": Path(v).read_bytes(), "path": Path(v).name} for v in vids],
                                        pa.struct([("bytes", pa.binary()), ("path", pa.string())]))})
    ds = datasets.Dataset(table).cast_column("video", datasets.Video(decode=False))
    path = str(tmp_path / "videos.parquet")
    ds.to_parquet(path)
    cfg = _cfg(tmp_path, format="parquet", columns={"media": "video"})
    t = _read_parquet(cfg, path)
    assert t.column("media_uri").to_pylist() == [Path(v).name for v in vids]  # the path field
    assert t.column("media_type").to_pylist() == ["video"] * 2
    assert t.column("media_bytes").to_pylist() == [Path(v).read_bytes() for v in vids]
    assert t.column("identity").to_pylist() == [f"{path}#0", f"{path}#1"]  # rows, not the (reusable) names


# --- HTTP -----------------------------------------------------------------------------------

class _Server:
    """A threaded HTTP server on loopback: good media and faults."""

    def __init__(self):
        self.hits: dict[str, int] = {}
        # /slow.png's body stalls until the test sets this (or 60 s pass: then `slow_gave_up` counts it)
        self.release_slow = threading.Event()
        self.slow_gave_up = 0
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.png = _png(7)
        owner = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                owner.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def handle(self, h):
        counted = h.path.startswith("/wait")  # in flight: the per-host limit test's requests only
        with self.lock:
            n = self.hits[h.path] = self.hits.get(h.path, 0) + 1
            self.in_flight += counted
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self._reply(h, h.path, n)
        finally:
            with self.lock:
                self.in_flight -= counted

    def _reply(self, h, path, n):
        def send(code, body=b"", headers=()):
            h.send_response(code)
            for k, v in headers:
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)

        if path == "/good.png":
            send(200, self.png)
        elif path in ("/gone", "/missing.png", "/denied"):
            send({"/gone": 410, "/missing.png": 404, "/denied": 403}[path])
        elif path == "/throttled.png":
            send(429, headers=[("Retry-After", "1")]) if n == 1 else send(200, self.png)
        elif path == "/flaky.png":
            send(503) if n == 1 else send(200, self.png)
        elif path == "/slow.png":
            h.send_response(200)
            h.send_header("Content-Length", "100")
            h.end_headers()
            h.wfile.write(b"x")
            h.wfile.flush()
            if not self.release_slow.wait(60):
                with self.lock:
                    self.slow_gave_up += 1
        elif path == "/big.png":
            send(200, b"\0" * 5000)
        elif path == "/big-unsized.png":
            h.send_response(200)
            h.end_headers()
            h.wfile.write(b"\0" * 5000)
            h.close_connection = True
        elif path.startswith("/wait"):
            time.sleep(0.3)
            send(200, self.png)
        else:
            send(500)

    def close(self):
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def http_server():
    s = _Server()
    yield s
    s.close()


FAST = StorageOptions(max_attempts=3, backoff_s=0.01, backoff_max_s=0.05, read_timeout_s=0.5, connect_timeout_s=0.5)


@pytest.mark.slow
def test_http_good_permanent_and_transient(http_server):
    u = http_server.url
    assert read_bytes(f"{u}/good.png", FAST) == http_server.png
    for path in ("/missing.png", "/denied", "/gone"):
        with pytest.raises(MediaError, match="HTTP 4"):
            read_bytes(u + path, FAST)
        assert http_server.hits[path] == 1  # permanent: no retry
    t0 = time.monotonic()
    assert read_bytes(f"{u}/throttled.png", FAST) == http_server.png
    assert time.monotonic() - t0 >= 0.95  # Retry-After: 1 honoured (our backoff would be 0.05 s)
    assert read_bytes(f"{u}/flaky.png", FAST) == http_server.png and http_server.hits["/flaky.png"] == 2
    try:  # the body stalls until released, so only the client's read timeout can end an attempt
        with pytest.raises(StorageError, match="after 3 attempts"):
            read_bytes(f"{u}/slow.png", FAST)
        assert http_server.hits["/slow.png"] == 3 and http_server.slow_gave_up == 0
    finally:
        http_server.release_slow.set()
    with pytest.raises(InputError, match="5000 bytes is over the image.max_bytes limit of 100"):
        read_bytes(f"{u}/big.png", FAST, max_bytes=100, limit_name="image.max_bytes")
    with pytest.raises(InputError, match="more than 100 bytes"):
        read_bytes(f"{u}/big-unsized.png", FAST, max_bytes=100)  # no Content-Length: cut while streaming


@pytest.mark.slow
def test_http_per_host_limit(http_server):
    lim = HostLimiter(2)
    http_server.max_in_flight = 0
    threads = [threading.Thread(target=read_bytes, args=(f"{http_server.url}/wait{i}.png", FAST),
                                kwargs={"limiter": lim}) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert http_server.max_in_flight == 2


# --- checkpoint on S3 ----------------------------------------------------------------------

def _fetch(args):
    from vlbatch.operators.storage.checkpoint_cache import fetch_checkpoint

    uri, endpoint, cache, barrier = args
    barrier.wait()
    r = fetch_checkpoint(uri, StorageOptions(endpoint_url=endpoint, region="us-east-1"), cache)
    return r.path, r.downloaded


@pytest.fixture(scope="module")
def s3_ckpt(tiny_ckpt):
    import os
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="models")
    ckpt = Path(tiny_ckpt("dense"))
    for f in ckpt.rglob("*"):
        if f.is_file():
            s3.upload_file(str(f), "models", f"tiny/{f.relative_to(ckpt)}")
    yield {"endpoint": endpoint, "uri": "s3://models/tiny", "local": ckpt, "s3": s3}
    server.stop()


@pytest.mark.slow
def test_checkpoint_on_s3_downloaded_once_by_two_processes(s3_ckpt, tmp_path):
    cache = str(tmp_path / "cache")
    stale = Path(cache)
    stale.mkdir()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        barrier = m.Barrier(2)
        with ctx.Pool(2) as pool:
            got = pool.map(_fetch, [(s3_ckpt["uri"], s3_ckpt["endpoint"], cache, barrier)] * 2)
    assert sorted(d for _, d in got) == [False, True]  # one download, the other waited for it
    assert got[0][0] == got[1][0]
    local = Path(got[0][0])
    for f in s3_ckpt["local"].rglob("*"):
        if f.is_file():
            assert (local / f.relative_to(s3_ckpt["local"])).read_bytes() == f.read_bytes()
    assert not list(Path(cache).glob("*.partial-*"))
    # a changed checkpoint is a new folder, never the old one or a mix
    s3_ckpt["s3"].put_object(Bucket="models", Key="tiny/extra.txt", Body=b"new")
    again = _fetch((s3_ckpt["uri"], s3_ckpt["endpoint"], cache, mp.Barrier(1)))
    assert again[1] and again[0] != got[0][0] and (Path(again[0]) / "extra.txt").read_bytes() == b"new"
    s3_ckpt["s3"].delete_object(Bucket="models", Key="tiny/extra.txt")
