"""`vlbatch run` and its Ray: which cluster (never an unasked-for running one), the reachability
probe before `ray.init` (real sockets: a gRPC server, an HTTP/1 server, a closed port, a port
that accepts and never speaks) and the CLI's exit 5 within 30 s; missing local paths refused
(exit 2) before Ray starts."""
from __future__ import annotations

import http.server
import socket
import threading
from concurrent import futures

import pytest
from test_jobs_support import vlbatch, write_job

from vlbatch.jobs.connect import RayTarget, probe
from vlbatch.jobs.errors import EXIT_UNREACHABLE, EXIT_USAGE, ClusterUnreachableError


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def silent_port():
    """A port whose kernel accepts connections (listen backlog) but that never sends a byte."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


def test_target_never_joins_an_unasked_for_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert RayTarget.choose(None).address is None  # a new local Ray, not address="auto"
    assert RayTarget.choose("local").address is None
    assert RayTarget.choose("auto").address == "auto"  # joining the machine's Ray only when asked
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # a submitted job: its own cluster
    assert RayTarget.choose(None).address == "10.0.0.5:6379"
    assert RayTarget.choose("127.0.0.1:7000").address == "127.0.0.1:7000"
    assert RayTarget("10.0.0.5:6379").gcs_host_port() == ("10.0.0.5", 6379)
    assert RayTarget("ray://head:10001").gcs_host_port() == ("head", 10001)
    assert RayTarget("[::1]:6379").gcs_host_port() == ("::1", 6379)
    assert RayTarget("auto").gcs_host_port() is None and RayTarget("head").gcs_host_port() is None


@pytest.mark.slow
def test_probe_passes_a_grpc_server_and_names_every_failure(silent_port):
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        probe("127.0.0.1", port, timeout_s=5)
    finally:
        server.stop(None)
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ClusterUnreachableError, match="does not speak gRPC"):
            probe("127.0.0.1", httpd.server_address[1], timeout_s=5)
    finally:
        httpd.shutdown()
    closed = _closed_port()
    with pytest.raises(ClusterUnreachableError, match=f"127.0.0.1:{closed}: Connection refused"):
        probe("127.0.0.1", closed)
    with pytest.raises(ClusterUnreachableError, match="accepts connections but did not answer within 1s"):
        probe("127.0.0.1", silent_port, timeout_s=1)  # the port never answers: only the probe's timeout ends this


def _run_unreachable(cfg, port: int, why: str) -> None:
    r = vlbatch("run", str(cfg), "--no-lock", "--address", f"127.0.0.1:{port}", timeout=120)  # a hang guard only
    assert r.returncode == EXIT_UNREACHABLE, r.stdout + r.stderr
    assert r.stderr.splitlines() == [r.stderr.strip()] and f"127.0.0.1:{port}" in r.stderr and why in r.stderr
    assert "[vlbatch] job" not in r.stdout  # nothing ran


@pytest.mark.slow
def test_run_against_a_closed_or_silent_port_exits_5_with_one_line(tmp_path, tiny_ckpt, silent_port):
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=1)
    _run_unreachable(cfg, _closed_port(), "Connection refused")
    _run_unreachable(cfg, silent_port, "did not answer")


@pytest.mark.slow
def test_missing_model_and_input_fail_validation_before_ray(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=1)
    bad = ["--set", f"model.path={tmp_path / 'nope'}", "--set", f"input.uri={tmp_path / 'none-*.jsonl'}"]
    for cmd in (["validate"], ["run", "--no-lock"]):
        r = vlbatch(*cmd, str(cfg), *bad, timeout=120)  # a hang guard only
        assert r.returncode == EXIT_USAGE, r.stdout + r.stderr
        assert f"model.path: {tmp_path / 'nope'} does not exist" in r.stderr
        assert "input.uri: the glob" in r.stderr and "matches no files" in r.stderr
        assert "[vlbatch] ray" not in r.stdout and "Traceback" not in r.stderr  # refused before Ray started
