"""Issue 48 ("Untrusted inputs, round three"), items 1, 2, 7 and 9: storage paths, output URIs,
stalled HTTP bodies, NUL bytes.

Real parts only: moto's S3 server on loopback (`s3_server` in conftest) for the checkpoint keys, a
loopback HTTP server that trickles bytes for the deadlines, the real `DecodeStage` for "the batch
goes on". The tests that would block forever on the old code carry a `timeout` marker: a hang is a
failure, never a stuck suite.
"""
from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vlbatch.operators.errors import ConfigError, InputError, StorageError
from vlbatch.operators.storage import StorageOptions, read_bytes
from vlbatch.pipeline.config import validate_config

# -- 1: checkpoint keys and shard names that leave the folder ---------------------------------------


@pytest.fixture(scope="module")
def ckpt_bucket(s3_server):
    client = s3_server.client()
    client.create_bucket(Bucket="issue48-ckpt")
    return s3_server


def _escaping_key(prefix: str, target: Path) -> str:
    """An object key under `prefix` whose `..` parts climb to `/` and then down to `target`."""
    return f"{prefix}/" + "../" * 40 + str(target).lstrip("/")


@pytest.mark.parametrize("bad", ["escape", "absolute", "dot"])
def test_checkpoint_keys_that_leave_the_folder_are_refused_before_any_download(ckpt_bucket, tmp_path, bad):
    from vlbatch.operators.storage.checkpoint_cache import fetch_checkpoint

    client, prefix = ckpt_bucket.client(), f"ckpt-{bad}"
    target = tmp_path / "escaped.txt"
    key = {"escape": _escaping_key(prefix, target), "absolute": f"{prefix}//{str(target).lstrip('/')}",
           "dot": f"{prefix}/./config.json"}[bad]
    client.put_object(Bucket="issue48-ckpt", Key=f"{prefix}/config.json", Body=b"{}")
    client.put_object(Bucket="issue48-ckpt", Key=key, Body=b"written outside the cache")
    cache = tmp_path / "cache"
    opts = StorageOptions(endpoint_url=ckpt_bucket.endpoint_url, region="us-east-1", max_attempts=1)
    with pytest.raises(ConfigError) as e:
        fetch_checkpoint(f"s3://issue48-ckpt/{prefix}", opts, str(cache))
    msg = str(e.value)
    assert "\n" not in msg and "model.path" in msg and "outside" in msg, msg
    assert not target.exists()
    # nothing downloaded: not even the good config.json reached the cache
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_checkpoint_folder_markers_are_not_names(ckpt_bucket, tmp_path):
    """Empty `name/` objects (a console's "create folder") are folders, not files named ''."""
    from vlbatch.operators.storage.checkpoint_cache import fetch_checkpoint

    client, prefix = ckpt_bucket.client(), "ckpt-markers"
    for key, body in ((f"{prefix}/", b""), (f"{prefix}/sub/", b""), (f"{prefix}/sub/a.txt", b"a"),
                      (f"{prefix}/config.json", b"{}")):
        client.put_object(Bucket="issue48-ckpt", Key=key, Body=body)
    opts = StorageOptions(endpoint_url=ckpt_bucket.endpoint_url, region="us-east-1", max_attempts=1)
    got = Path(fetch_checkpoint(f"s3://issue48-ckpt/{prefix}", opts, str(tmp_path / "cache")).path)
    assert (got / "sub" / "a.txt").read_bytes() == b"a" and (got / "config.json").read_bytes() == b"{}"


@pytest.mark.slow
def test_checkpoint_index_shard_names_are_checked_before_any_download(ckpt_bucket, tmp_path):
    from vlbatch.operators.storage.checkpoint_cache import fetch_checkpoint

    client, prefix = ckpt_bucket.client(), "ckpt-index"
    index = {"weight_map": {"a.weight": "model-00001.safetensors", "b.weight": "../../../etc/passwd"}}
    client.put_object(Bucket="issue48-ckpt", Key=f"{prefix}/model.safetensors.index.json", Body=json.dumps(index))
    client.put_object(Bucket="issue48-ckpt", Key=f"{prefix}/model-00001.safetensors", Body=b"x")
    cache = tmp_path / "cache"
    opts = StorageOptions(endpoint_url=ckpt_bucket.endpoint_url, region="us-east-1", max_attempts=1)
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json.*\.\./\.\./\.\./etc/passwd") as e:
        fetch_checkpoint(f"s3://issue48-ckpt/{prefix}", opts, str(cache))
    assert "\n" not in str(e.value)
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/abs/model.safetensors", "sub/../../x.safetensors"])
def test_local_index_shard_names_outside_the_folder_are_refused(tmp_path, shard):
    from vlbatch.operators.model.loader import CheckpointError, checkpoint_files
    from vlbatch.pipeline.plan.checkpoint import _weights_problem

    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")  # exists: the old check only asked "is it a file"
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(CheckpointError, match="outside"):
        checkpoint_files(root)
    problem = _weights_problem(root)
    assert problem is not None and "outside" in problem and shard in problem


# -- 2: output URIs are an allow-list of persistent filesystems --------------------------------------

def _job(tmp_path, output: str) -> dict:
    return {"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": output}}


@pytest.mark.parametrize("uri", ["memory://x", "http://127.0.0.1:1/out", "https://host/out", "ftp://h/out",
                                 "gs://bucket/out"])
def test_output_uri_outside_the_allow_list_is_refused_by_validate(tmp_path, uri):
    with pytest.raises(ConfigError) as e:
        validate_config(_job(tmp_path, uri))
    msg = str(e.value)
    assert "output.uri" in msg and "s3://" in msg and uri.split("://")[0] in msg, msg


@pytest.mark.parametrize("uri", ["{tmp}/out", "file://{tmp}/out", "s3://bucket/out", "s3a://bucket/out"])
def test_persistent_output_uris_pass_validate(tmp_path, uri):
    validate_config(_job(tmp_path, uri.format(tmp=tmp_path)))


def test_sink_and_inspect_refuse_the_same_uris(tmp_path):
    from vlbatch.jobs.inspect.run import resolve_run
    from vlbatch.operators.sink.parquet import ParquetSink

    for uri in ("memory://x/run", "http://127.0.0.1:1/run"):
        with pytest.raises(ConfigError, match="output.uri"):
            ParquetSink(uri)
        with pytest.raises(ConfigError, match="output.uri"):
            resolve_run(uri)
    ParquetSink(str(tmp_path / "run"))  # a local folder is fine


# -- 7: a trickling HTTP response ends at the deadline or below the minimum rate ---------------------

def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


class _Trickle(BaseHTTPRequestHandler):
    """/body: headers at once, then one byte every 0.1 s with no Content-Length, until the test
    ends; /steady: 1 KiB every 0.05 s, forever (above any small minimum rate); /headers: the
    header lines themselves one byte at a time; /good.png: an image with its Content-Length."""

    stop: threading.Event
    png: bytes

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        try:
            if self.path == "/good.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(self.png)))
                self.end_headers()
                self.wfile.write(self.png)
            elif self.path == "/headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                self._drip(b"a", 0.1)
            else:
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self._drip(b"\x89" if self.path == "/body" else b"y" * 1024, 0.1 if self.path == "/body" else 0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up: what the fix does

    def _drip(self, piece: bytes, every: float) -> None:
        while not self.stop.is_set():
            self.wfile.write(piece)
            self.wfile.flush()
            self.stop.wait(every)


@pytest.fixture
def trickle():
    stop = threading.Event()
    handler = type("Handler", (_Trickle,), {"stop": stop, "png": _png()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    stop.set()  # the handlers end their drip, whatever the test did
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, opts", [
    ("/body", {"http_min_bytes_per_s": 1000, "http_rate_window_s": 0.5, "http_total_timeout_s": 3600}),
    ("/steady", {"http_min_bytes_per_s": 10, "http_rate_window_s": 0.5, "http_total_timeout_s": 1}),
    ("/headers", {"http_min_bytes_per_s": 0, "http_total_timeout_s": 1}),
], ids=["below-min-rate", "past-the-deadline", "trickled-headers"])
@pytest.mark.slow
def test_read_http_ends_a_trickling_response_with_storage_error(trickle, path, opts):
    from vlbatch.operators.storage.http import read_http

    storage = StorageOptions(max_attempts=1, read_timeout_s=5, **opts)
    with pytest.raises(StorageError) as e:
        read_http(f"{trickle}{path}", storage)
    assert not e.value.permanent and "\n" not in str(e.value)
    assert ("http_min_bytes_per_s" if path == "/body" else "http_total_timeout_s") in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_headers_have_the_unscaled_deadline(trickle):
    from vlbatch.operators.storage.http import read_http

    # the whole response may take ~10^6 s (max_bytes at the minimum rate), the headers only 1 s
    storage = StorageOptions(max_attempts=1, read_timeout_s=5, http_total_timeout_s=1, http_min_bytes_per_s=1000)
    with pytest.raises(StorageError, match="no response headers within 1 s"):
        read_http(f"{trickle}/headers", storage, max_bytes=1 << 30)


def test_the_deadline_scales_with_max_bytes():
    from vlbatch.operators.storage.http import response_deadline_s

    s = StorageOptions(http_total_timeout_s=300, http_min_bytes_per_s=1 << 16)
    assert response_deadline_s(s, None) == 300
    assert response_deadline_s(s, 1 << 20) == 300  # 16 s at the minimum rate: the floor holds
    assert response_deadline_s(s, 2 << 30) == (2 << 30) / (1 << 16)  # a body at the minimum rate always fits
    assert response_deadline_s(StorageOptions(http_total_timeout_s=5, http_min_bytes_per_s=0), 2 << 30) == 5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_good_image_beside_a_trickling_one_still_gets_its_row(trickle, tmp_path):
    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.requests import expand
    from vlbatch.pipeline.stages.rows import Decoded, MediaTask, from_table, to_table

    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)},
                           "storage": {"retries": 0, "http_total_timeout_s": 3, "http_min_bytes_per_s": 0}})
    rows = [expand(f"{trickle}/body.png", "image", None, cfg.task), expand(f"{trickle}/good.png", "image", None,
                                                                          cfg.task)]
    out = from_table(DecodeStage(cfg)(to_table(rows, MediaTask)), Decoded)
    assert (out[0].status, out[0].error_type) == ("error", "StorageError"), out[0].error_message
    assert "http_total_timeout_s" in out[0].error_message
    assert out[1].status == "ok" and out[1].frames.shape[-3:] == (32, 32, 3)


# -- 9: a NUL byte in a path is permanent bad input ---------------------------------------------------

@pytest.mark.parametrize("uri", ["{tmp}/a\x00b.jpg", "s3://bucket/a\x00b.jpg", "http://127.0.0.1:1/a\x00b.jpg"])
def test_a_nul_byte_in_a_path_is_an_input_error(tmp_path, uri):
    uri = uri.format(tmp=tmp_path)
    with pytest.raises(InputError, match="NUL") as e:
        read_bytes(uri, StorageOptions(max_attempts=1))
    assert e.value.permanent and "\x00" not in str(e.value)  # the message names it, printable


def test_a_nul_byte_in_a_media_uri_is_a_permanent_error_row(tmp_path):
    from vlbatch.operators.storage.retry import classify
    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.requests import expand

    assert classify(ValueError("embedded null byte")) == "permanent"
    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}})
    row = DecodeStage(cfg).decode_one(expand(f"{tmp_path}/a\x00b.jpg", "image", None, cfg.task))
    assert (row.status, row.error_type) == ("error", "InputError"), row.error_message


def test_validate_refuses_a_remote_checkpoint_whose_keys_leave_the_folder(ckpt_bucket, tmp_path):
    from vlbatch.pipeline.plan.checkpoint import check_model

    client, prefix = ckpt_bucket.client(), "ckpt-preflight"
    client.put_object(Bucket="issue48-ckpt", Key=f"{prefix}/config.json", Body=b"{}")
    client.put_object(Bucket="issue48-ckpt", Key=_escaping_key(prefix, tmp_path / "x.txt"), Body=b"x")
    cfg = validate_config({"model": {"path": f"s3://issue48-ckpt/{prefix}"}, "input": {"uri": "x"},
                           "output": {"uri": str(tmp_path)},
                           "storage": {"endpoint_url": ckpt_bucket.endpoint_url, "region": "us-east-1", "retries": 0}})
    with pytest.raises(ConfigError, match=r"model.path: the object .*\.\./\.\./") as e:
        check_model(cfg)
    assert "outside" in str(e.value)
