"""The Airflow DAG (infra/airflow) under real Airflow (`dag.test()`), against the local Ray head.

Airflow runs from its own virtualenv (`.venv-airflow`, made by `make test` or by this
module through infra/airflow/setup-venv.sh, linked to this interpreter's site-packages) in a
subprocess, with a throwaway AIRFLOW_HOME (sqlite metadata DB migrated here). Checks: a slot whose first attempt was stopped is
resumed by the DAG run (same submission id root, same run id) and produces the job's
complete Parquet output; a failing job fails the task and the run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_jobs_support import REPO, TEST_ENV, read_output, vlbatch, write_job

DAG_DIR = REPO / "infra" / "airflow"
LOGICAL_DATE = "2026-11-29T02:00:00+00:00"
SLOT = "20261129T0200"
pytestmark = pytest.mark.ray  # jobs on the session's Jobs API head (`ray_jobs_head`)


def _airflow_python() -> Path:
    """The venv's python, made (~35 s) or refreshed (a second) the way `make test` does, with
    this interpreter as $PY so that the Airflow task imports this checkout's vlbatch."""
    venv = Path(os.environ.get("VLBATCH_AIRFLOW_VENV", REPO / ".venv-airflow"))
    subprocess.run([str(DAG_DIR / "setup-venv.sh"), str(venv)], check=True, cwd=REPO,
                   env=dict(os.environ, PY=sys.executable))
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    py = _airflow_python()
    home = tmp_path_factory.mktemp("airflow_home")
    env = dict(os.environ, **TEST_ENV, AIRFLOW_HOME=str(home), AIRFLOW__CORE__DAGS_FOLDER=str(DAG_DIR),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", VLBATCH_AIRFLOW_RETRIES="0")
    env.pop("RAY_ADDRESS", None)
    for args in (["db", "migrate"], ["dags", "reserialize"]):
        r = subprocess.run([str(py), "-m", "airflow", *args], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

    def run_dag(conf: dict) -> tuple[dict, str]:
        r = subprocess.run([str(py), str(DAG_DIR / "run_dag_test.py"), LOGICAL_DATE, json.dumps(conf)],
                           env=env, capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("DAG_RESULT ")]
        assert lines, out[-4000:]
        return json.loads(lines[-1].removeprefix("DAG_RESULT ")), out

    return run_dag


def test_dag_resumes_a_stopped_slot_and_writes_the_output(airflow, ray_jobs_head, tiny_ckpt, tmp_path):
    wd = tmp_path / "wd"
    cfg = write_job(wd, tiny_ckpt("dense"), n_images=6)
    addr = ["--address", ray_jobs_head.dashboard_url]
    sid = f"vlb-afjob-{SLOT}"
    # An earlier try of this slot that was stopped (a killed Airflow worker, say).
    first = vlbatch("submit", str(cfg), "--workdir", str(wd), "--name", "afjob", "--slot", SLOT, *addr)
    assert first.returncode == 0, first.stderr
    assert vlbatch("stop", sid, "--wait", *addr).returncode == 0

    result, log = airflow({"config": str(cfg), "workdir": str(wd), "address": ray_jobs_head.dashboard_url,
                           "job_name": "afjob"})
    assert result == {"state": "success", "tasks": {"run_vlbatch": "success"}}, log[-4000:]
    assert f"resumed {sid}-r1" in log and "[ray job]" in log  # resumed, with the job's logs in the task log
    status = json.loads(vlbatch("status", sid, "--json", *addr).stdout)
    assert [a["status"] for a in status["attempts"]] == ["STOPPED", "SUCCEEDED"]
    rows = read_output(tmp_path / "output" / sid)
    assert sorted(r["media_uri"] for r in rows) == sorted(str(p) for p in (wd / "media").glob("*.png"))
    assert {r["status"] for r in rows} == {"ok"}


def test_failing_job_fails_the_task(airflow, ray_jobs_head, tiny_ckpt, tmp_path):
    wd = tmp_path / "wd"
    cfg = write_job(wd, tiny_ckpt("dense"), n_images=1)
    (wd / "manifest.jsonl").unlink()  # the job fails on the cluster: its manifest is gone
    result, log = airflow({"config": str(cfg), "workdir": str(wd), "address": ray_jobs_head.dashboard_url,
                           "job_name": "afbad"})
    assert result == {"state": "failed", "tasks": {"run_vlbatch": "failed"}}, log[-4000:]
    assert "VlbatchJobFailed" in log and f"vlb-afbad-{SLOT} ended FAILED" in log
