"""Ray's own autoscaler on fake nodes: the model pool scales a GPU node group up from zero,
the job completes, and the GPU nodes scale back down.

The head runs the CPU stages (decode, preprocess, write); the only worker type,
``gpu_worker``, offers ``GPU: 1``, which the model actor pool requests
(``resources.model.num_gpus: 1``). The fake GPU makes Ray place the model actor there;
the actor still computes on CPU (``model.device: cpu``), since no real GPU exists here.
The autoscaler runs as in production (`fake_multinode` provider, see
`test_jobs_support.RayHead.start`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from test_jobs_support import REPO, TEST_ENV, RayHead, read_output, write_job

N_IMAGES = 8
# its own head: Ray's autoscaler on fake nodes (a GPU node type), which the session's Ray has not
pytestmark = pytest.mark.ray
GPU_TYPE = {"gpu_worker": {"resources": {"CPU": 1, "GPU": 1}, "min_workers": 0, "max_workers": 2}}


@pytest.fixture(autouse=True)
def _state_api_on_the_own_head(monkeypatch):
    """Ray's state API (`list_nodes(address=...)`) takes RAY_ADDRESS over its `address`: the session's (set for a
    test marked `ray`, tests/conftest.py) has no dashboard. This module's tests use their own head's."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def autoscaling_head():
    head = RayHead.start(num_cpus=2, worker_node_types=GPU_TYPE)
    yield head
    head.stop()


def _gpu_nodes_alive(head: RayHead) -> int:
    from ray.util.state import list_nodes

    nodes = list_nodes(address=head.dashboard_url, detail=False)
    return sum(1 for n in nodes if n.state == "ALIVE" and n.resources_total.get("GPU", 0) > 0)


def test_model_pool_scales_gpu_nodes_up_from_zero_and_back(autoscaling_head, tiny_ckpt, tmp_path):
    head = autoscaling_head
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=N_IMAGES, model_num_gpus=1)
    assert _gpu_nodes_alive(head) == 0, "no GPU node before the job"

    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:  # sample the real node table while the job runs
        while not done.is_set():
            seen.append(_gpu_nodes_alive(head))
            done.wait(1.0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    env = dict(os.environ, **TEST_ENV)
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--address", head.gcs_address, "--no-lock",
         "--set", "output.run_id=autoscale"],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )
    done.set()
    watcher.join()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert max(seen) >= 1, f"the model pool never got a GPU node: {seen}"
    assert max(seen) <= GPU_TYPE["gpu_worker"]["max_workers"]

    rows = read_output(tmp_path / "output" / "autoscale")
    assert sorted(r["media_uri"] for r in rows) == sorted(str(p) for p in (tmp_path / "wd" / "media").glob("*.png"))
    assert {r["status"] for r in rows} == {"ok"}

    # Idle GPU nodes go away (idle_timeout_minutes 0.1 in the fake cluster config).
    deadline = time.monotonic() + 120
    while _gpu_nodes_alive(head) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert _gpu_nodes_alive(head) == 0, "GPU nodes did not scale back down"
