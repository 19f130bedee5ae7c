"""Hardening of the storage layer, the sink and the manifest/request path (no Ray cluster).

Local files of every kind (symlink loops, FIFOs, devices, sparse files), a real S3 API
(moto server on loopback, `s3_server` in conftest) and an endpoint where nothing listens.
Reads that could block or exhaust memory run in a subprocess with a timeout.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from vlbatch.operators.errors import ConfigError, InputError, MediaError, StorageCheckError
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OutputRow, rows_to_table
from vlbatch.operators.storage import StorageOptions, read_bytes
from vlbatch.pipeline.config import validate_config

QUICK = {"max_attempts": 2, "backoff_s": 0.01, "backoff_max_s": 0.02}


def run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter; its stdout is one JSON line."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, check=False)


# -- 7: a symlink loop is permanent ---------------------------------------------------------------

def test_symlink_loop_is_a_permanent_media_error(tmp_path, caplog):
    a, b = tmp_path / "a.jpg", tmp_path / "b.jpg"
    a.symlink_to(b)
    b.symlink_to(a)
    with caplog.at_level(logging.WARNING, logger="vlbatch.operators.storage.retry"):
        with pytest.raises(MediaError) as e:
            read_bytes(str(a), StorageOptions(**QUICK))
    assert e.value.permanent and "a.jpg" in str(e.value)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


# -- 8: non-regular files never block and are never read ------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "socket", "directory"])
def test_non_regular_files_are_refused_at_once(tmp_path, kind):
    import socket

    path = tmp_path / "x.jpg"
    keep = None
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path = "/dev/zero"
    elif kind == "socket":
        keep = socket.socket(socket.AF_UNIX)
        keep.bind(str(path))
    else:
        path.mkdir()
    # a subprocess: a blocking open or an endless read must fail the test, not hang or OOM it
    r = run_py(f"""
        import json, resource
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from vlbatch.operators.storage import read_bytes
        try:
            read_bytes({str(path)!r})
            print(json.dumps({{"error": None}}))
        except Exception as e:
            print(json.dumps({{"error": type(e).__name__, "msg": str(e)}}))
    """, timeout=30)
    if keep is not None:
        keep.close()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] == "MediaError", (out, r.stderr[-2000:])


# -- 9: max_bytes is checked before reading, and bounds the read -----------------------------------

def test_a_sparse_file_over_the_limit_is_refused_without_reading_it(tmp_path):
    big = tmp_path / "huge.jpg"
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # 3 GiB, sparse: no disk, but a whole read would need 3 GiB of memory
    r = run_py(f"""
        import json, resource
        from vlbatch.operators.storage import read_bytes
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            read_bytes({str(big)!r}, max_bytes=64 << 20, limit_name="image.max_bytes")
            err = None
        except Exception as e:
            err = [type(e).__name__, str(e)]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        print(json.dumps({{"err": err, "peak_kib": peak, "base_kib": base}}))
    """, timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["err"][0] == "InputError" and "image.max_bytes" in out["err"][1] and str(3 << 30) in out["err"][1]
    assert out["peak_kib"] - out["base_kib"] < 64 << 10, out  # under 64 MiB above the interpreter's own


def test_max_bytes_boundary_and_growth_locally(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(b"x" * 100)
    assert read_bytes(str(p), max_bytes=100) == b"x" * 100
    with pytest.raises(InputError, match="101 bytes is over the max_bytes limit of 100"):
        p.write_bytes(b"x" * 101)
        read_bytes(str(p), max_bytes=100)
    assert read_bytes(str(p)) == b"x" * 101  # no limit: the whole file


@pytest.fixture(scope="module")
def s3(s3_server):
    client = s3_server.client()
    client.create_bucket(Bucket="hardening-out")
    client.put_object(Bucket="hardening-out", Key="m/big.jpg", Body=b"y" * (1 << 20))
    client.put_object(Bucket="hardening-out", Key="m/empty.jpg", Body=b"")
    return s3_server


def s3_options(url: str) -> StorageOptions:
    return StorageOptions(endpoint_url=url, region="us-east-1", **QUICK)


def test_max_bytes_on_s3_uses_the_object_size(s3):
    opts = s3_options(s3.endpoint_url)
    with pytest.raises(InputError, match=f"{1 << 20} bytes is over the video.max_bytes limit of 1000"):
        read_bytes("s3://hardening-out/m/big.jpg", opts, max_bytes=1000, limit_name="video.max_bytes")
    assert read_bytes("s3://hardening-out/m/big.jpg", opts, max_bytes=1 << 20) == b"y" * (1 << 20)
    assert read_bytes("s3://hardening-out/m/empty.jpg", opts, max_bytes=10) == b""


def test_decode_stage_reports_max_bytes_before_reading(tmp_path):
    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.requests import expand

    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(5000)
    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)},
                           "image": {"max_bytes": 4096}})
    stage = DecodeStage(cfg)
    row = stage.decode_one(expand(str(big), None, None, cfg.task))
    assert (row.status, row.error_type) == ("error", "InputError")
    assert "5000 bytes is over the image.max_bytes limit of 4096" in row.error_message


# -- 11: null / empty media_uri ---------------------------------------------------------------

def test_null_and_empty_media_uri_are_input_errors_keeping_the_value(tmp_path):
    from vlbatch.pipeline.sources.manifest import normalise
    from vlbatch.pipeline.stages.requests import expand
    from vlbatch.pipeline.stages.write_stage import output_rows  # noqa: F401 - the writer takes the row as is

    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}})
    t = normalise(pa.table({"media_uri": [None, "", "a.jpg"]}), cfg, "/data/manifests")
    assert t.column("media_uri").to_pylist() == [None, "", "/data/manifests/a.jpg"]
    rows = [expand(u, None, None, cfg.task) for u in t.column("media_uri").to_pylist()]
    assert [r.media_uri for r in rows] == [None, "", "/data/manifests/a.jpg"]
    assert [r.error_type for r in rows] == ["InputError", "InputError", None]
    assert "media_uri is null" in rows[0].error_message and "media_uri is empty" in rows[1].error_message
    assert rows[0].ids != rows[1].ids and rows[0].ids != expand("None", None, None, cfg.task).ids
    # the error row commits with the original value (null stays null)
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    out = [OutputRow(id=r.ids[0], request_index=0, media_uri=r.media_uri, media_type=r.media_type,
                     prompt=r.prompts[0], status="error", model="m", run_id="r", error_type=r.error_type,
                     error_message=r.error_message) for r in rows[:2]]
    sink.commit(rows_to_table(out))
    assert sorted(sink.read().column("media_uri").to_pylist(), key=str) == ["", None]


# -- 12: identical requests run once -----------------------------------------------------------

def test_identical_manifest_rows_expand_to_one_request(tmp_path):
    from vlbatch.pipeline.stages.expansion import DUPLICATES_COLUMN, expand_batch

    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)},
                           "task": {"mode": "questions", "questions": ["q1", "q2"]}})
    from vlbatch.pipeline.sources.base import manifest_table

    batch = manifest_table(4, media_uri=["/a.jpg", "/b.jpg", "/a.jpg", "/a.jpg"],
                           questions=[None, None, None, ["q1", "q3"]])  # a block as every source gives it
    out = expand_batch(batch, cfg=cfg, done=frozenset())
    ids = [i for row in out.column("ids").to_pylist() for i in row]
    assert len(ids) == len(set(ids)) == 5  # a:q1 a:q2 b:q1 b:q2 a:(1, q3); the copies of a:q1/q2 dropped
    assert sum(out.column(DUPLICATES_COLUMN).to_pylist()) == 3
    assert out.column("media_uri").to_pylist() == ["/a.jpg", "/b.jpg", "/a.jpg"]


# -- 14, 15: the output location is checked before work; buckets are never created ----------------

def job(tmp_path, output: str, endpoint: str) -> dict:
    man = tmp_path / "m.jsonl"
    man.write_text(json.dumps({"media_uri": "x.jpg"}) + "\n")
    return {"model": {"path": str(tmp_path)}, "input": {"uri": str(man), "format": "jsonl"},
            "output": {"uri": output, "run_id": "r"},
            "storage": {"endpoint_url": endpoint, "region": "us-east-1", "retries": 1}}


def test_missing_output_bucket_is_a_config_error_and_never_created(s3, tmp_path, tiny_ckpt):
    from vlbatch.pipeline.graph import run_job

    cfg = job(tmp_path, "s3://no-such-bucket-typo/out", s3.endpoint_url)
    cfg["model"]["path"] = str(tiny_ckpt("dense"))  # a real checkpoint: the preflight's earlier steps pass
    cfg = validate_config(cfg)
    with pytest.raises(ConfigError, match="output.uri") as e:
        run_job(cfg)
    assert "no-such-bucket-typo" in str(e.value)
    # the sink itself never creates it either
    ParquetSink("s3://no-such-bucket-typo/out/r", s3_options(s3.endpoint_url)).prepare()
    names = [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert "no-such-bucket-typo" not in names


def test_existing_bucket_passes_the_check(s3, tmp_path):
    from vlbatch.pipeline.plan.fingerprint import check_output

    check_output(validate_config(job(tmp_path, "s3://hardening-out/new/prefix", s3.endpoint_url)))


@pytest.mark.slow
def test_cli_missing_bucket_exits_2_with_one_line(s3, tmp_path, tiny_ckpt):
    import yaml

    path = tmp_path / "job.yaml"
    cfg = job(tmp_path, "s3://typo-bucket-cli/out", s3.endpoint_url)
    cfg["model"]["path"] = str(tiny_ckpt("dense"))  # a real checkpoint: only the bucket is wrong
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(path), "--no-lock"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **s3.env})
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("vlbatch:")]  # (Ray may log a line of its own)
    assert len(lines) == 1 and "output.uri" in lines[0] and "Traceback" not in r.stderr


def test_unreachable_output_endpoint_is_one_storage_error(tmp_path, caplog, tiny_ckpt, monkeypatch):
    """Found by the preflight's output step: one `StorageCheckError` line naming output.uri (exit 2, issue 50)."""
    from conftest import free_port

    from vlbatch.pipeline.graph import run_job

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")  # credentials, so the request goes out and is refused
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    cfg = job(tmp_path, "s3://out/x", f"http://127.0.0.1:{free_port()}")
    cfg["model"]["path"] = str(tiny_ckpt("dense"))  # a real checkpoint: the preflight's earlier steps pass
    cfg = validate_config(cfg)
    with caplog.at_level(logging.WARNING, logger="vlbatch.operators.storage.retry"):
        with pytest.raises(StorageCheckError, match=r"^output.uri: .*StorageError: .*after 2 attempts") as e:
            run_job(cfg)
    assert "\n" not in str(e.value)
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 1


# -- 17: an empty _tmp/ is removed at the end ------------------------------------------------

def test_finish_removes_an_empty_tmp_only(tmp_path):
    row = OutputRow(id="a", request_index=0, media_uri="/x", media_type="image", prompt="p", status="ok",
                    model="m", run_id="r")
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    sink.commit(rows_to_table([row]))
    tmp = tmp_path / "run" / "_tmp"
    assert tmp.is_dir() and not any(tmp.iterdir())
    (tmp / "writer.partial").write_bytes(b"x")  # a writer's file: kept
    sink.finish()
    assert tmp.is_dir()
    (tmp / "writer.partial").unlink()
    sink.finish()
    assert not tmp.exists() and sink.read().num_rows == 1


# -- 18 (start-up half): pools that cannot start are refused on a fixed-size cluster --------------

def test_pools_that_do_not_fit_a_fixed_cluster_are_refused(tmp_path, caplog):
    from vlbatch.pipeline.plan.cluster import Cluster
    from vlbatch.pipeline.plan.fit import check_fit

    def check_cpus_fit(cfg, cpus, fixed_size):  # the one fit check, on a cluster of `cpus` CPUs
        check_fit(cfg, Cluster(cpus, 0.0, 64 << 30, fixed_size, "the cluster"))

    base = {"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}}
    demo = {"preprocess": {"num_cpus": 0.5}, "model": {"num_cpus": 1}, "write": {"num_cpus": 0.25}}
    check_cpus_fit(validate_config({**base, "resources": demo}), 2.0, fixed_size=True)  # 1.75 + the read
    big = validate_config({**base, "resources": {**demo, "write": {"num_cpus": 0.5}}})
    with pytest.raises(ConfigError, match="resources"):
        check_cpus_fit(big, 2.0, fixed_size=True)
    with caplog.at_level(logging.WARNING, logger="vlbatch.pipeline"):
        check_cpus_fit(big, 2.0, fixed_size=False)
    assert "2.05 CPUs" in caplog.text
