"""`vlbatch run` as a user sees it (a real subprocess on a tiny job, a new local Ray): the first
line is the plan (input count, pools), printed before Ray starts, then a phase line, then the
line naming the cluster, the last says what the run produced, and Ray's start-up noise (token
banner, core-worker lines, Ray Data messages) stays off the terminal unless --verbose.

Token auth is left at Ray's default here (RAY_AUTH_MODE unset, HOME a temp folder so the
token Ray generates lands there): that is what prints the token banner to hide. The --verbose rerun
joins the session's Ray (tests/conftest.py): its subject is what --verbose lets through, not a start."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_jobs_support import REPO, TEST_ENV, write_job

from vlbatch.pipeline.config import load_config

NOISE = [
    re.compile(r"core_worker\.cc"),
    re.compile(r"Token authentication is (enabled|disabled)"),
    re.compile(r"Progress bars disabled"),
    re.compile(r"Dataset \S+ execution finished"),
    re.compile(r"^\S+ \S+\s+(INFO|WARNING) \S+\.py:\d+ -- ", re.M),  # any Ray Python log line
    re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [DIWE] \d+ \d+\] \S+\.cc:\d+:", re.M),  # any Ray C++ log line
]


# the occupancy verdict (`telemetry/occupancy.Occupancy.verdict`) ends the line when a pool waited past 30 %
# of the run: on a loaded machine even this 2-image run's model can be the busy side ("grow the model pool")
VERDICT = r"(; [^;]+: grow the (CPU|write|model) pool \([^)]*\))?"


def _run(cfg, home, *extra: str, join: bool = False) -> subprocess.CompletedProcess:
    """`vlbatch run` starting a new local Ray with Ray's default token auth, or (`join`) joining the
    session's (tests/conftest.py: RAY_ADDRESS, token auth off as that cluster's)."""
    env = dict(os.environ, **TEST_ENV, HOME=str(home))
    if not join:
        for k in ("RAY_AUTH_MODE", "RAY_ADDRESS"):
            env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--no-lock", *extra],
                          capture_output=True, text=True, timeout=400, env=env, cwd=REPO)


@pytest.mark.ray
def test_run_names_its_cluster_reports_its_output_and_hides_ray_noise(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2, write_batch=2)
    config = load_config(cfg)
    run_dir = f"{tmp_path / 'output'}/{config.resolved_run_id()}/"
    home = tmp_path / "home"
    home.mkdir()

    first = _run(cfg, home)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    lines = first.stdout.splitlines()
    assert re.fullmatch(r"\[vlbatch\] plan: 2 media from .*manifest\.jsonl; pools: .*; reserves [\d.]+ CPUs, 0 GPUs",
                        lines[0]), lines
    assert lines[1] == "[vlbatch] starting Ray", lines
    assert re.fullmatch(r"\[vlbatch\] ray: new local cluster \(\d+ CPUs; metrics: http://[\d.]+:\d+/metrics\)",
                        lines[2]), lines
    assert "[vlbatch] starting the actors and loading the model" in first.stderr  # the runner's phases: stderr
    assert re.fullmatch(rf"\[vlbatch\] done: 2 ok, 0 error, 0 skipped \(already committed\) -> "
                        rf"{re.escape(run_dir)} in \d+\.\ds{VERDICT}", lines[-1]), lines
    for pat in NOISE:
        assert not pat.search(out), (pat.pattern, out[-4000:])
    assert (home / ".ray" / "auth_token").exists()  # Ray did enable token auth: its banner was hidden

    for part in Path(run_dir).glob("part-*.parquet"):  # work again (nothing left would start no Ray)
        part.unlink()
    again = _run(cfg, home, "--verbose", join=True)  # a rerun (on the session's Ray); Ray's own lines allowed
    assert again.returncode == 0, again.stderr[-4000:]
    assert re.fullmatch(rf"\[vlbatch\] done: 2 ok, 0 error, 0 skipped \(already committed\) -> "
                        rf"{re.escape(run_dir)} in \d+\.\ds{VERDICT}", again.stdout.splitlines()[-1])
    assert any(pat.search(again.stdout + again.stderr) for pat in NOISE)  # --verbose shows Ray's output
