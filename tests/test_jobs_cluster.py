"""`vlbatch` against a real local Ray head with the Jobs API (started by the `ray_jobs_head`
fixture): submit, status --json, logs (plain and --follow), stop, a duplicate slot refused,
another slot refused while the job runs, resume after stop completing the job, list, and
the exit codes for unknown ids and unreachable clusters. The job is the real pipeline
(`vlbatch run` as the entrypoint) on a tiny checkpoint and generated images."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_jobs_support import read_output, vlbatch, write_job

from vlbatch.jobs.errors import EXIT_DUPLICATE, EXIT_NOT_FOUND, EXIT_OVERLAP, EXIT_UNREACHABLE

pytestmark = pytest.mark.ray  # the Jobs API head of its own (`ray_jobs_head`): the session's Ray has no dashboard
N_IMAGES = 6
# The job's gate: every Ray worker process of the submitted job runs this (Ray's
# `worker_process_setup_hook`, shipped in the working directory) and waits until the test creates
# the file named by VLB_TEST_GATE. Until then the driver runs but no task or actor can, so the job
# is RUNNING, with nothing committed, for as long as the test needs: no race with a fast job on an
# idle machine or a slow poll on a loaded one.
GATE_HOOK = '''import os
import time


def wait():
    gate = os.environ.get("VLB_TEST_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.1)
'''


def _status(sid: str, addr: list[str]) -> dict:
    r = vlbatch("status", sid, "--json", *addr)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _wait_for(pred, what: str, timeout_s: float = 240.0, poll_s: float = 0.5):
    """Poll a real condition (job state, committed files) until it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def _check_guards_while_running(submit: list[str], sid: str, cfg, wd, addr: list[str]) -> None:
    """What a scheduler's retries meet while `sid` runs: the same slot refused (its own exit code,
    nothing new starts) or attached to, another slot of the job refused by the overlap guard."""
    dup = vlbatch(*submit)
    assert dup.returncode == EXIT_DUPLICATE, dup.stderr
    assert "already exists" in dup.stderr and "not started" in dup.stderr
    att = vlbatch(*submit, "--attach", "--json")
    assert att.returncode == 0 and json.loads(att.stdout) | {"run_id": sid} == {
        "submission_id": sid, "action": "attached", "run_id": sid, "slot": "20261129T0200"}
    other = vlbatch("submit", str(cfg), "--workdir", str(wd), "--name", "clitest", "--slot", "20261130T0200", *addr)
    assert other.returncode == EXIT_OVERLAP, other.stderr


def test_submit_duplicate_stop_resume_completes(ray_jobs_head, tiny_ckpt, tmp_path):
    wd = tmp_path / "wd"
    cfg = write_job(wd, tiny_ckpt("dense"), n_images=N_IMAGES, max_tokens=16, write_batch=2)
    (wd / "vlb_gate.py").write_text(GATE_HOOK)
    (tmp_path / "runtime_env.yaml").write_text("worker_process_setup_hook: vlb_gate.wait\n")
    gate = tmp_path / "gate"
    addr = ["--address", ray_jobs_head.dashboard_url]
    submit = ["submit", str(cfg), "--workdir", str(wd), "--name", "clitest", "--slot", "20261129T0200", *addr,
              "--runtime-env", str(tmp_path / "runtime_env.yaml"), "--env", f"VLB_TEST_GATE={gate}"]

    r = vlbatch(*submit, "--json")
    assert r.returncode == 0, r.stderr
    sub = json.loads(r.stdout)
    sid = sub["submission_id"]
    assert sid == "vlb-clitest-20261129T0200" and sub["run_id"] == sid and sub["action"] == "submitted"

    _check_guards_while_running(submit, sid, cfg, wd, addr)

    run_dir = tmp_path / "output" / sid
    # Stop once the driver is running the pipeline (its first log line is out); the gate holds every
    # worker, so the job is still running whatever the machine's load.
    _wait_for(lambda: f"run_id={sid}" in vlbatch("logs", sid, *addr).stdout, "the driver's first log line")
    assert _status(sid, addr)["status"] == "RUNNING"
    stop = vlbatch("stop", sid, "--wait", *addr)
    assert stop.returncode == 0, stop.stderr
    st = _status(sid, addr)
    assert st["status"] == "STOPPED" and st["attempt"] == 0 and len(st["attempts"]) == 1
    partial = read_output(run_dir) if run_dir.exists() else []
    assert partial == [], "nothing committed behind the gate"

    gate.touch()  # the resumed attempt (same runtime env) runs through
    res = vlbatch("resume", sid, "--workdir", str(wd), *addr)
    assert res.returncode == 0, res.stderr
    assert f"resumed as {sid}-r1" in res.stdout
    follow = vlbatch("logs", sid, "--follow", *addr)  # the root id follows its latest attempt
    assert follow.returncode == 0, follow.stdout + follow.stderr
    assert f"run_id={sid}" in follow.stdout

    st = _status(sid, addr)
    assert st["status"] == "SUCCEEDED" and st["submission_id"] == f"{sid}-r1"
    assert [a["status"] for a in st["attempts"]] == ["STOPPED", "SUCCEEDED"]
    rows = read_output(run_dir)
    uris = sorted(r["media_uri"] for r in rows)
    expected = sorted(str(p) for p in (wd / "media").glob("*.png"))
    assert uris == expected, "every image exactly once after stop + resume"
    assert {r["status"] for r in rows} == {"ok"} and {r["run_id"] for r in rows} == {sid}
    committed_first = {r["id"] for r in partial}
    assert committed_first <= {r["id"] for r in rows}

    # Scheduler-style retry after success: nothing runs again.
    again = vlbatch(*submit, "--attach", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["action"] == "done"
    assert "nothing to resume" in vlbatch("resume", sid, "--workdir", str(wd), *addr).stdout
    listed = json.loads(vlbatch("list", "--json", *addr).stdout)
    assert {sid, f"{sid}-r1"} <= {j["submission_id"] for j in listed}


def test_unknown_id_and_unreachable_cluster(ray_jobs_head, tmp_path: Path):
    r = vlbatch("status", "vlb-nope-1", "--address", ray_jobs_head.dashboard_url)
    assert r.returncode == EXIT_NOT_FOUND and "vlb-nope-1" in r.stderr
    r = vlbatch("stop", "vlb-nope-1", "--address", ray_jobs_head.dashboard_url)
    assert r.returncode == EXIT_NOT_FOUND
    r = vlbatch("list", "--address", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert r.returncode == EXIT_UNREACHABLE and "cannot reach" in r.stderr
