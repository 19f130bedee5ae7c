"""Shared fixtures: tiny checkpoints in the real Hugging Face layout, built once per session."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Ray starts its worker processes at niceness 15: beside CPU-heavy processes at niceness 0 (other jobs
# on a CI runner; issue 33's check, `make test` beside two CPU burners) every test that runs Ray starved
# (57 tests in 18 minutes). The suite's own clusters (every ray.init / `ray start` / `vlbatch run` below
# inherits this) run their workers at 0, so they share the machine like any other process.
os.environ.setdefault("RAY_worker_niceness", "0")
# The compiled CPU kernels at numba's own SIMD width: the model actors' per-machine probe
# (operators/host_simd.py, ~35 s the first time on a machine) is tested in tests/test_host_simd.py.
os.environ.setdefault("VLBATCH_SIMD", "off")


@pytest.fixture(autouse=True)
def own_lock_dir(tmp_path_factory, monkeypatch):
    """Each test's runs take their job locks (`jobs/scheduling.run_lock`) in a folder of their own, not the user's
    ~/.cache/vlbatch/locks: a job of the same name beside the suite (the developer's own, or an earlier test's run
    still exiting under load) made a test's `vlbatch run` refuse to start ("already running")."""
    monkeypatch.setenv("VLBATCH_LOCK_DIR", str(tmp_path_factory.mktemp("locks")))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: one torch thread avoids OpenMP spin contention on a shared 2-core runner.

    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`; restores the setting after the module.
    """
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=[{}, {"static_decode": True}], ids=["eager", "static_decode"])
def engine_kw(request):
    """Engine options every exactness test runs under: the eager step, and decode steps on the
    padded static buffers (what CUDA graphs replay; eager on the CPU)."""
    return request.param


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """`tiny_ckpt(variant, shards=1)` -> Path of a tiny random checkpoint (cached per session)."""
    from vlbatch.devtools.checkpoints import make_tiny_checkpoint

    cache: dict = {}

    def get(variant: str = "dense", shards: int = 1):
        key = (variant, shards)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{variant}_{shards}")
            cache[key] = make_tiny_checkpoint(out, variant, shards=shards)
        return cache[key]

    return get


# A test marked `ray` starts or joins Ray, or runs `vlbatch run`; every other test may do neither (the guard
# below fails it at once). `make test-fast` runs `-m "not ray and not slow"`; `make test` runs everything.
SESSION_GLOB = "ray/session_2*"  # what a Ray start leaves under RAY_TMPDIR (ray/session_<date>_<pid>)


@dataclass(frozen=True)
class SessionRay:
    """The suite's one local Ray (2 CPUs, as CI's machine), started by this process on the first test marked
    `ray`. `address`: its GCS address, exported as RAY_ADDRESS so a `vlbatch run` child joins it (a test whose
    subject is a local start pops it); `metrics_port`: its node's Prometheus endpoint."""

    address: str
    metrics_port: int


def start_session_ray() -> SessionRay:
    """A new local Ray for the session, as `vlbatch run`'s own (metrics exported every 2 s)."""
    import ray

    from vlbatch.jobs.connect import LOCAL_SYSTEM_CONFIG

    ray.shutdown()
    port = free_port()
    os.environ["RAY_AUTH_MODE"] = "disabled"  # children join with no token (TEST_ENV says the same)
    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=port,
                   _system_config=LOCAL_SYSTEM_CONFIG,
                   runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
    return SessionRay(ctx.address_info["gcs_address"], port)


def session_ray(holder: list[SessionRay]) -> SessionRay:
    """The session's Ray with this process connected to it: as held, else started (again) and held. A module
    fixture that runs Ray calls it itself (it runs before the test's `ray_cluster`)."""
    import ray

    if not (holder and ray.is_initialized() and ray.get_runtime_context().gcs_address == holder[0].address):
        holder[:] = [start_session_ray()]
    return holder[0]


@pytest.fixture(scope="session")
def session_ray_holder():
    holder: list[SessionRay] = []
    yield holder
    import ray

    ray.shutdown()


@pytest.fixture
def ray_cluster(session_ray_holder, monkeypatch) -> SessionRay:
    """The session's Ray, connected in this process, RAY_ADDRESS naming it for children. Started again if a
    test left this process on another cluster (its own `ray.init`, a multi-node `Cluster`) or on none."""
    held = session_ray(session_ray_holder)
    monkeypatch.setenv("RAY_ADDRESS", held.address)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    return held


@pytest.fixture
def two_cpu_ray(ray_cluster):
    """The session's Ray: 2 CPUs, as CI's machine, one torch thread per worker, no dashboard."""
    return ray_cluster


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request, monkeypatch):
    """A test marked `ray` gets the session's Ray. Any other test may start no Ray: `ray.init` in this process
    raises naming the marker, and a child (`vlbatch run`) that starts one leaves its session folder under the
    test's own RAY_TMPDIR, which fails the test at teardown (the fast tier's promise: no Ray)."""
    if request.node.get_closest_marker("ray"):
        request.getfixturevalue("ray_cluster")
        yield
        return
    import ray

    def refused(*_a, **_k):
        raise RuntimeError(f"{request.node.nodeid} starts Ray: mark it `pytest.mark.ray` (tests/conftest.py)")

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # `vlbatch validate` plans for this machine, as a user's
    ray_tmp = Path(tempfile.mkdtemp(prefix="vlbt", dir="/tmp"))  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    yield
    started = [p.name for p in ray_tmp.glob(SESSION_GLOB)]
    shutil.rmtree(ray_tmp, ignore_errors=True)
    if started:
        pytest.fail(f"{request.node.nodeid} started Ray ({started[0]}): mark it `pytest.mark.ray`", pytrace=False)


@pytest.fixture(scope="session")
def ray_jobs_head():
    """A real local Ray head with the dashboard and Jobs API (jobs/infra tests); stopped at teardown."""
    from test_jobs_support import RayHead

    head = RayHead.start()
    yield head
    head.stop()


@dataclass(frozen=True)
class S3Server:
    """A moto S3 server on loopback. Credentials are fake and also exported as AWS_* env vars.

    endpoint_url: `http://127.0.0.1:<port>`; env: the variables a child process (Ray worker,
    subprocess) needs to reach it with the standard AWS credential chain.
    """

    endpoint_url: str
    region: str
    access_key: str
    secret_key: str

    @property
    def env(self) -> dict:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": self.region, "AWS_ENDPOINT_URL_S3": self.endpoint_url}

    def client(self):
        """A boto3 S3 client for arranging test data (create buckets, put objects)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region,
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto server mode, in a thread of this process) on 127.0.0.1:<free port>.

    Yields `S3Server`. While the session runs, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
    AWS_DEFAULT_REGION are set to the fake credentials (restored at teardown) so code under
    test finds them the standard way. Buckets are shared by the session: use unique names.
    """
    from moto.server import ThreadedMotoServer

    server = S3Server(endpoint_url="", region="us-east-1", access_key="testing-key-id",
                      secret_key="testing-secret-key")
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    server = S3Server(f"http://127.0.0.1:{port}", server.region, server.access_key, server.secret_key)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update({k: v for k, v in server.env.items() if k in saved})
    try:
        yield server
    finally:
        moto.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
