"""Test support for the jobs/infra tests (no tests here): a real local Ray head with the Jobs API.

`RayHead.start()` runs ``ray start --head --block`` in its own process group with every
port chosen free and a private temp dir, so it never collides with other Ray instances
on the machine, and `stop()` ends exactly that process group (never `ray stop`, which
would kill every Ray on the host).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Token auth off explicitly: otherwise Ray turns it on whenever some earlier local
# ray.init() on this machine left ~/.ray/auth_token behind, and the tests would depend on it.
# PATH: a submitted job's entrypoint is `python -m vlbatch.jobs.cli ...`, resolved on the cluster's PATH;
# the suite's clusters are this interpreter's, so its folder comes first (a virtualenv used without
# being activated would otherwise run the machine's other `python` and its other vlbatch).
TEST_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class RayHead:
    proc: subprocess.Popen
    gcs_address: str
    dashboard_url: str
    temp_dir: Path

    @classmethod
    def start(
        cls, num_cpus: int = 2, timeout_s: float = 180.0, worker_node_types: dict | None = None,
    ) -> RayHead:
        """Start the head; with `worker_node_types` it runs Ray's autoscaler on fake nodes.

        Fake nodes are Ray's own `fake_multinode` provider, the mechanism behind
        `ray.cluster_utils.AutoscalingCluster`; that class itself is not usable here: its
        start() and shutdown() run `ray stop --force`, which kills every Ray process on the
        host (other test sessions included), and the wheel lacks the example.yaml it reads.
        """
        (gcs, dash, agent_http, agent_grpc, rt_env, metrics, client, nm, om) = free_ports(9)
        temp_dir = Path(tempfile.mkdtemp(prefix="vlbj", dir="/tmp"))
        extra_env = {}
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={gcs}", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
            f"--ray-client-server-port={client}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
            f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats",
        ]
        if worker_node_types:
            cfg = fake_autoscaling_config(num_cpus, worker_node_types, gcs_address=f"{_node_ip()}:{gcs}")
            (temp_dir / "autoscaling.json").write_text(json.dumps(cfg))
            cmd.append(f"--autoscaling-config={temp_dir / 'autoscaling.json'}")
            extra_env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        env = dict(os.environ, **TEST_ENV, **extra_env)
        env.pop("RAY_ADDRESS", None)
        log = open(temp_dir / "head.log", "wb")  # noqa: SIM115 - lives as long as the head
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        head = cls(proc, f"{_node_ip()}:{gcs}", f"http://127.0.0.1:{dash}", temp_dir)
        head._wait_ready(timeout_s)
        return head

    def _wait_ready(self, timeout_s: float) -> None:
        """Poll the Jobs API until it answers (the head is usable only then)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited: {(self.temp_dir / 'head.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        tail = (self.temp_dir / "head.log").read_text()[-3000:]
        self.stop()
        raise RuntimeError(f"ray head not ready after {timeout_s}s; its log ends:\n{tail}")

    def stop(self) -> None:
        # The head's daemons (gcs, raylet, dashboard, workers) are all in its process group.
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _node_ip() -> str:
    import ray._private.services

    return ray._private.services.get_node_ip_address()


def fake_autoscaling_config(head_cpus: int, worker_node_types: dict, *, gcs_address: str) -> dict:
    """Cluster config for Ray's fake_multinode provider (worker nodes are local raylets)."""
    types = {"ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}}
    for name, t in worker_node_types.items():
        types[name] = {"node_config": {}, **t}
    return {
        "cluster_name": "vlbatch-fake",
        "max_workers": sum(t["max_workers"] for t in worker_node_types.values()),
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


def vlbatch(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None,
            local_ray: bool = False):
    """Run the real CLI as a user would (a subprocess); returns CompletedProcess.

    `vlbatch run` joins the session's Ray (RAY_ADDRESS, tests/conftest.py `ray_cluster`: the test is marked
    `ray`), or starts a local Ray of its own with `local_ray` (a test whose subject is that start); every other
    command plans for this machine as a user's would (no RAY_ADDRESS)."""
    full_env = dict(os.environ, **TEST_ENV, **(env or {}))
    if args[:1] != ("run",) or local_ray:
        full_env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "vlbatch.jobs.cli", *args], capture_output=True, text=True, timeout=timeout,
        env=full_env, cwd=cwd or REPO,
    )


def write_job(
    workdir: Path, model_dir: Path, *, n_images: int, name: str = "job.yaml", max_tokens: int = 4,
    write_batch: int = 4, output: Path | None = None, extra: str = "", model_num_gpus: float = 0,
) -> Path:
    """A real job in `workdir`: `n_images` PNGs, a JSONL manifest, and a config -> config path.

    The output goes to `output` (default: ``<workdir>/../output``), outside the packaged dir.
    """
    import json

    import numpy as np
    from PIL import Image

    media = workdir / "media"
    media.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n_images):
        rng = np.random.default_rng(i)
        img = (rng.random((48 + 4 * (i % 5), 64, 3)) * 255).astype("uint8")
        p = media / f"img{i:03d}.png"
        Image.fromarray(img).save(p)
        lines.append(json.dumps({"media_uri": str(p), "media_type": "image"}))
    (workdir / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    out = output or workdir.parent / "output"
    cfg = workdir / name
    cfg.write_text(f"""model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{uri: {workdir / 'manifest.jsonl'}, format: jsonl}}
task: {{prompt: Describe.}}
sampling: {{max_tokens: {max_tokens}}}
image: {{max_pixels: 12544}}
resources:
  decode: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}}
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}}
  model: {{num_cpus: 0.25, num_gpus: {model_num_gpus}, min_actors: 1, max_actors: 1, batch_size: 2}}
  write: {{num_cpus: 0.25, batch_size: {write_batch}}}
output: {{uri: {out}}}
ray: {{progress_interval_s: 1}}
{extra}""")
    return cfg


def read_output(run_dir: Path):
    """All committed rows of a run directory as a list of dicts (Parquet parts only)."""
    import pyarrow.parquet as pq

    rows = []
    for f in sorted(run_dir.glob("*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


@dataclass
class RayWorkerNode:
    """A worker node (its own raylet, `ray start --address=GCS --block`) joined to a `RayHead`, in
    its own process group: `kill()` SIGKILLs that group, so the raylet and every worker process it
    started die at once, as when a machine is lost. `env`: extra environment of the raylet (and so
    of its workers)."""

    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, head: RayHead, *, num_cpus: float, num_gpus: float = 0, env: dict | None = None,
              name: str = "worker") -> RayWorkerNode:
        (nm, om, agent_http, agent_grpc, rt_env, metrics) = free_ports(6)
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={head.gcs_address}", "--block",
            f"--node-manager-port={nm}", f"--object-manager-port={om}",
            f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
            f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}", "--disable-usage-stats",
        ]
        full_env = dict(os.environ, **TEST_ENV, **(env or {}))
        full_env.pop("RAY_ADDRESS", None)
        log_path = head.temp_dir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the node
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        return cls(proc, log_path)

    def pids(self, match: str) -> list[int]:
        """This node's Ray worker processes (descendants of its `ray start`; Ray puts each worker in a
        process group of its own) titled `ray::...match...`."""
        parent, title = {}, {}
        for d in os.listdir("/proc"):
            try:
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                title[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue

        def ours(pid: int) -> bool:
            for _ in range(16):
                if pid == self.proc.pid:
                    return True
                pid = parent.get(pid, 0)
                if pid <= 1:
                    return False
            return False

        return [p for p, t in title.items() if t.startswith("ray::") and match in t and ours(p)]

    def kill(self) -> None:
        """SIGKILL the node: its workers (found first: they leave the group) and its process group
        (the raylet and its agents), then reap it."""
        workers = self.pids("")
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)


def alive_nodes(head: RayHead) -> int:
    from ray.util.state import list_nodes

    return sum(1 for n in list_nodes(address=head.dashboard_url, detail=False) if n.state == "ALIVE")


def wait_nodes(head: RayHead, n: int, timeout_s: float = 400.0) -> None:
    """Until `n` nodes are alive (a start-up wait, never a synchronisation of the test)."""
    deadline = time.monotonic() + timeout_s
    while alive_nodes(head) != n:
        if time.monotonic() > deadline:
            logs = "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in head.temp_dir.glob("*.log"))
            raise RuntimeError(f"{n} Ray nodes not alive after {timeout_s}s\n{logs}")
        time.sleep(0.5)


def start_workers(head: RayHead, specs: dict[str, dict]) -> dict[str, RayWorkerNode]:
    """Worker nodes `{name: RayWorkerNode.start keywords}` joined one at a time (raylets started at once
    on a loaded machine time out registering), each started again once if it exits while joining."""
    nodes: dict[str, RayWorkerNode] = {}
    try:
        for name, kw in specs.items():
            for attempt in range(2):
                node = RayWorkerNode.start(head, name=f"{name}-{attempt}", **kw)
                deadline = time.monotonic() + 400
                while node.proc.poll() is None and alive_nodes(head) < len(nodes) + 2 and time.monotonic() < deadline:
                    time.sleep(0.5)
                if node.proc.poll() is None:
                    break
            nodes[name] = node
        wait_nodes(head, len(specs) + 1)
    except BaseException:
        for node in nodes.values():
            node.kill()
        raise
    return nodes
