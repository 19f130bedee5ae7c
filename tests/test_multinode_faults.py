"""Issue 48: a worker node lost mid-run, rehearsed on a real multi-node Ray cluster on this machine.

The head (2 CPUs, no GPU) and two worker nodes (each its own raylet, 1 CPU and one logical GPU:
`RayWorkerNode`) form one cluster; the job asks `resources.model.num_gpus: 1` with
`min_actors: 2`, so exactly one model actor lands on each worker node (the actor computes on
the CPU, `model.device: cpu`: the GPU is only a placement token here), and Ray Data spreads its
CPU actors over all three nodes. The runs are the real CLI (`vlbatch run CFG --address GCS`).

A clean run gives the reference answers. In the second run one worker node is SIGKILLed (its
raylet and every worker on it) once rows are committed and that node holds a model actor; the
last media are served by a loopback HTTP server only after the kill, so the run is still going
then on a machine of any speed. The job must finish on the remaining node with every request id
exactly once and the clean run's answers. When every GPU worker node is lost instead, the run
stops in one line (exit 8) after `ray.node_loss_timeout_s`, its committed rows kept.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_jobs_support import REPO, TEST_ENV, RayHead, RayWorkerNode, read_output, start_workers, wait_nodes
from test_pipeline_progress import _Gate, _pngs

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # heads and worker nodes of their own (a node killed)

MEDIA = 10
GATED = 2  # the last media: answered only after the kill


@pytest.fixture(autouse=True)
def _state_api_on_the_own_head(monkeypatch):
    """Ray's state API (`list_nodes(address=...)`) takes RAY_ADDRESS over its `address`: the session's (set for a
    test marked `ray`, tests/conftest.py) has no dashboard. This module's tests use their own head's."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def three_nodes():
    head = RayHead.start(num_cpus=2)
    workers = {}
    try:
        workers = start_workers(head, {f"w{i}": {"num_cpus": 1, "num_gpus": 1} for i in range(2)})
        yield head, list(workers.values())
    finally:
        for w in workers.values():
            w.kill()
        head.stop()


def job_config(tmp_path: Path, ckpt: str, uris: list[str], **extra) -> dict:
    """The job both multi-node tests run: one model actor per worker node (num_gpus 1, min 2)."""
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"media_uri": uris}), manifest)
    return {
        "model": {"path": ckpt, "dtype": "float32", "device": "cpu"},
        "input": {"uri": str(manifest), "format": "parquet", "columns": {"media_type": None}},
        "task": {"prompt": "Describe."}, "sampling": {"max_tokens": 4},
        "image": {"min_pixels": 16384, "max_pixels": 16384},  # blocks of ~2 media (plan/spec.block_bytes)
        "resources": {"preprocess": {"num_cpus": 0.25, "batch_size": 2, "min_actors": 1, "max_actors": 2},
                      "model": {"num_cpus": 0.25, "num_gpus": 1, "min_actors": 2, "max_actors": 2,
                                "batch_size": 2, "max_concurrent_batches": 2},
                      "write": {"num_cpus": 0.25, "batch_size": 1, "max_actors": 1}},
        "output": {"uri": str(tmp_path / "out"), "part_rows": 1, "commit_interval_s": 1},
        "ray": {"progress_interval_s": 0.5}, "max_error_fraction": 0.0, **extra,
    }


def start_run(cfg: dict, head: RayHead, run_id: str, path: Path, env: dict | None = None) -> subprocess.Popen:
    path.write_text(json.dumps(cfg))  # JSON is YAML
    full_env = dict(__import__("os").environ, **TEST_ENV, **(env or {}))
    full_env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "vlbatch.jobs.cli", "run", str(path), "--address", head.gcs_address, "--no-lock",
         "--set", f"output.run_id={run_id}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=full_env, cwd=REPO)


def answers(run_dir: Path) -> dict[str, list]:
    """{id: [(status, answer), ...]} of a run's committed rows (a list: an id twice would show)."""
    out: dict[str, list] = {}
    for r in read_output(run_dir):
        out.setdefault(r["id"], []).append((r["status"], r["answer"]))
    return out


def _committed(run_dir: Path) -> int:
    n = 0
    for f in run_dir.glob("part-*.parquet"):
        try:
            n += pq.read_metadata(f).num_rows
        except (FileNotFoundError, OSError):  # replaced by a roll between the listing and the read
            continue
    return n


def _kill_when_ready(head: RayHead, run_dir: Path, node: RayWorkerNode, run: subprocess.Popen, gate: _Gate,
                     record: dict) -> None:
    """SIGKILL `node` once >= 1 row is committed and it holds a model actor; then, once Ray counts the node
    dead (so the run sees the loss before its last media can be served), open the gate."""
    from ray.util.state import list_nodes

    deadline = time.monotonic() + 600  # a hung run only, never a synchronisation
    try:
        while time.monotonic() < deadline and run.poll() is None:
            if _committed(run_dir) >= 1 and node.pids("ModelStage"):
                record["committed_at_kill"] = _committed(run_dir)
                node.kill()
                record["killed"] = True
                break
            time.sleep(0.05)
        while record.get("killed") and time.monotonic() < deadline and run.poll() is None:
            if any(n.state == "DEAD" for n in list_nodes(address=head.dashboard_url)):
                record["dead_in_ray"] = True
                return
            time.sleep(0.2)
    finally:
        gate.open.set()


def test_worker_node_killed_mid_run_job_finishes_on_the_other(three_nodes, tiny_ckpt, tmp_path):
    head, (w0, w1) = three_nodes
    gate = _Gate(_pngs(MEDIA))
    uris = [f"{gate.url}/{'gated/' if i >= MEDIA - GATED else ''}m{i}.png" for i in range(MEDIA)]
    cfg = job_config(tmp_path, str(tiny_ckpt("dense")), uris)
    out = Path(cfg["output"]["uri"])
    try:
        gate.open.set()  # the clean run: nothing held back
        clean = start_run(cfg, head, "clean", tmp_path / "clean.json")
        clean_text, _ = clean.communicate(timeout=900)
        assert clean.returncode == 0, clean_text[-4000:]

        gate.open.clear()
        run = start_run(cfg, head, "killed", tmp_path / "killed.json")
        record: dict = {}
        killer = threading.Thread(target=_kill_when_ready, args=(head, out / "killed", w0, run, gate, record),
                                  daemon=True)
        killer.start()
        text, _ = run.communicate(timeout=900)
        killer.join(timeout=30)
    finally:
        gate.close()
    assert record.get("killed") and record.get("dead_in_ray"), f"the node was never killed: {record}\n{text[-4000:]}"
    assert record["committed_at_kill"] < MEDIA, "the kill came mid-run"
    assert run.returncode == 0, text[-4000:]
    want, got = answers(out / "clean"), answers(out / "killed")
    assert len(want) == MEDIA and all(v[0][0] == "ok" for v in want.values())
    assert {k: len(v) for k, v in got.items() if len(v) != 1} == {}, "every request id exactly once"
    assert got == want, "the answers of a clean run"
    lost = [ln for ln in text.splitlines() if "lost mid-run" in ln]  # issue 60 item 16: the run says it went on
    assert len(lost) == 1 and lost[0].startswith("[vlbatch] node ") and lost[0].endswith(
        "was lost mid-run; Ray retried its work on the nodes left and the run went on"), text[-4000:]
    assert "lost mid-run" not in clean_text


HELPERS = ("Meter", "Tally", "StartFailures")  # the run's own small actors, which the driver asks until the end


def _helper_nodes(head: RayHead) -> dict:
    """{class name: "head" or "worker"} of the run's alive helper actors (Ray's state API)."""
    from ray.util.state import list_actors, list_nodes

    head_id = next(n.node_id for n in list_nodes(address=head.dashboard_url) if n.is_head_node)
    return {a.class_name: "head" if a.node_id == head_id else "worker"
            for a in list_actors(address=head.dashboard_url, filters=[("state", "=", "ALIVE")])
            if a.class_name in HELPERS}


def _kill_all_when_committed(head: RayHead, run_dir: Path, nodes: list[RayWorkerNode], run: subprocess.Popen,
                             gate: _Gate, record: dict) -> None:
    """SIGKILL every node in `nodes` once >= 1 row is committed and each holds a model actor (noting where
    the run's helper actors are first); then open the gate."""
    deadline = time.monotonic() + 600  # a hung run only, never a synchronisation
    try:
        while time.monotonic() < deadline and run.poll() is None:
            if _committed(run_dir) >= 1 and all(n.pids("ModelStage") for n in nodes):
                record["helpers"] = _helper_nodes(head)
                for n in nodes:
                    n.kill()
                record["committed_at_kill"] = _committed(run_dir)
                record["killed"] = True
                return
            time.sleep(0.05)
    finally:
        gate.open.set()


def test_every_model_node_lost_mid_run_ends_the_run_in_one_line(three_nodes, tiny_ckpt, tmp_path):
    """Both GPU worker nodes SIGKILLed mid-run (the head has no GPU, so no model actor can live
    anywhere): after the grace `ray.node_loss_timeout_s` (3 s here) the run stops with one line
    naming the model stage and the node loss, exit 8 (an actor could not start), never a wait for
    a restart that cannot happen (before: a hang, failed here by the 300 s timeout). The rows
    committed before the loss stay, each id once."""
    head, workers = three_nodes
    gate = _Gate(_pngs(MEDIA))
    uris = [f"{gate.url}/{'gated/' if i >= MEDIA - GATED else ''}m{i}.png" for i in range(MEDIA)]
    cfg = job_config(tmp_path, str(tiny_ckpt("dense")), uris,
                     ray={"progress_interval_s": 0.5, "node_loss_timeout_s": 3})
    run_dir = Path(cfg["output"]["uri"]) / "lost"
    record: dict = {}
    try:
        run = start_run(cfg, head, "lost", tmp_path / "lost.json")
        killer = threading.Thread(target=_kill_all_when_committed, args=(head, run_dir, workers, run, gate, record),
                                  daemon=True)
        killer.start()
        try:
            text, _ = run.communicate(timeout=300)  # a hang fails here, never passes
        except subprocess.TimeoutExpired:
            run.kill()
            text, _ = run.communicate()
            pytest.fail(f"the run did not end after its model nodes were lost: {record}\n{text[-4000:]}")
        killer.join(timeout=30)
    finally:
        gate.close()
    assert record.get("killed"), f"the nodes were never killed: {record}\n{text[-4000:]}"
    # the driver asks its helper actors until the run ends: they live on its node, never on a node that may be lost
    assert record["helpers"] == dict.fromkeys(HELPERS, "head"), record
    assert run.returncode == 8, text[-4000:]
    last = [ln for ln in text.splitlines() if ln.startswith("vlbatch: ")]
    assert len(last) == 1, text[-4000:]
    assert last[0].startswith("vlbatch: the model stage lost its nodes (model.path="), last[0]
    assert "NodesLostError: ModelStage lost every node that can hold its actor (1 GPU, 0.25 CPU)" in last[0], last[0]
    assert "ray.node_loss_timeout_s=3s" in last[0], last[0]
    got = answers(run_dir)
    assert {k: len(v) for k, v in got.items() if len(v) != 1} == {}, "every committed id once"
    assert record["committed_at_kill"] <= len(got) < MEDIA, (record, len(got))  # the rows committed before stay
    assert all(v[0][0] == "ok" for v in got.values()), got


@pytest.fixture
def one_bad_node(tmp_path, s3_server):
    """The head and two GPU worker nodes; on `bad` the checkpoint cache folder cannot be made
    (`VLBATCH_CACHE` lies under a regular file: the root user writes anywhere, so no mode bits)."""
    (tmp_path / "not-a-folder").write_text("")
    aws = {k: v for k, v in s3_server.env.items() if k != "AWS_ENDPOINT_URL_S3"}
    head = RayHead.start(num_cpus=2)
    nodes = {}
    try:
        nodes = start_workers(head, {
            "good": {"num_cpus": 1, "num_gpus": 1, "env": {**aws, "VLBATCH_CACHE": str(tmp_path / "cache")}},
            "bad": {"num_cpus": 1, "num_gpus": 1,
                    "env": {**aws, "VLBATCH_CACHE": str(tmp_path / "not-a-folder" / "cache")}}})
        yield head, nodes, aws
    finally:
        for w in nodes.values():
            w.kill()
        head.stop()


def _s3_checkpoint(s3_server, ckpt: Path) -> str:
    s3 = s3_server.client()
    s3.create_bucket(Bucket="multinode-models")
    for f in ckpt.rglob("*"):
        if f.is_file():
            s3.upload_file(str(f), "multinode-models", f"tiny/{f.relative_to(ckpt)}")
    return "s3://multinode-models/tiny"


def test_replica_failing_on_one_node_runs_on_the_other_then_stops_when_none_is_left(
        one_bad_node, s3_server, tiny_ckpt, tmp_path):
    """A model replica (and any CPU actor) that cannot start on one node: the job runs on the good
    node and the summary names the failed node and the cause. With the good node gone, every
    replica fails: one line and a non-zero exit, never a wait for a replica that cannot start."""
    head, nodes, aws = one_bad_node
    gate = _Gate(_pngs(6))
    gate.open.set()
    cfg = job_config(tmp_path, _s3_checkpoint(s3_server, Path(tiny_ckpt("dense"))),
                     [f"{gate.url}/m{i}.png" for i in range(6)],
                     storage={"endpoint_url": s3_server.endpoint_url, "region": s3_server.region})
    out = Path(cfg["output"]["uri"])
    driver_env = {**aws, "VLBATCH_CACHE": str(tmp_path / "driver-cache")}
    try:
        run = start_run(cfg, head, "one-bad", tmp_path / "one.json", env=driver_env)
        text, _ = run.communicate(timeout=900)
        assert run.returncode == 0, text[-4000:]
        got = answers(out / "one-bad")
        assert len(got) == 6 and all(v == [("ok", v[0][1])] for v in got.values())
        failed = json.loads((out / "one-bad" / "_summary.json").read_text())["failed_starts"]
        bad_ip_lines = [ln for ln in failed if ln.startswith("ModelStage on node ")]
        assert bad_ip_lines, failed
        assert all("not-a-folder" in ln for ln in failed), failed  # the cause: the bad node's cache folder
        assert len({ln.split("(")[1].split(")")[0] for ln in failed}) == 1, "one node failed: the bad one"
        assert "an actor failed to start: ModelStage on node" in text

        nodes["good"].kill()  # the only node where a replica starts
        wait_nodes(head, 2)
        run = start_run(cfg, head, "none-left", tmp_path / "none.json", env=driver_env)
        text, _ = run.communicate(timeout=900)  # a hang fails here, never passes
    finally:
        gate.close()
    assert run.returncode == 8, text[-4000:]
    last = [ln for ln in text.splitlines() if ln.startswith("vlbatch: ")]
    assert len(last) == 1, text[-4000:]
    assert "the model stage could not start" in last[0] and "every node" in last[0], last[0]
    assert "not-a-folder" in last[0], last[0]
