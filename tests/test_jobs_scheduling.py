"""Scheduling and submission building without a cluster: cron slots, ids, the flock guard,
the job spec (entrypoint, runtime env, run id rule) and `vlbatch validate` exit codes."""
from __future__ import annotations

import datetime as dt
import json
import shlex
import subprocess
import sys

import pytest
from test_jobs_support import REPO, vlbatch, write_job

from vlbatch.jobs.errors import EXIT_OVERLAP, EXIT_USAGE, OverlapError, SubmissionError
from vlbatch.jobs.scheduling import format_slot, latest_slot, parse_cron, run_lock, submission_id
from vlbatch.jobs.spec import build_spec

UTC = dt.UTC


def _brute_latest(expr: str, now: dt.datetime) -> dt.datetime:
    """Naive reference: walk back minute by minute and test each minute against the fields."""
    s = parse_cron(expr)
    t = now.replace(second=0, microsecond=0)
    for _ in range(60 * 24 * 400):
        if t.minute in s.minutes and t.hour in s.hours and s.matches_day(t.date()):
            return t
        t -= dt.timedelta(minutes=1)
    raise AssertionError("no match")


@pytest.mark.parametrize("expr", [
    "0 2 * * *", "*/15 * * * *", "30 4 1,15 * *", "0 0 * * 0", "0 12 * * 1-5", "5 */6 * * 7",
    "0 0 13 * 5", "59 23 31 12 *", "0 9-17/4 * 2,8 *",
])
@pytest.mark.slow
def test_latest_slot_matches_naive_reference(expr):
    for now in (dt.datetime(2026, 11, 29, 17, 54, 31, tzinfo=UTC), dt.datetime(2027, 3, 1, 0, 0, tzinfo=UTC),
                dt.datetime(2028, 2, 29, 2, 0, 59, tzinfo=UTC)):
        assert latest_slot(expr, now) == _brute_latest(expr, now), (expr, now)


def test_retried_tick_maps_to_the_same_slot_and_id():
    tick = dt.datetime(2026, 11, 29, 2, 0, 3, tzinfo=UTC)
    late_retry = dt.datetime(2026, 11, 29, 7, 41, tzinfo=UTC)
    next_night = dt.datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
    slots = [format_slot(latest_slot("0 2 * * *", t)) for t in (tick, late_retry, next_night)]
    assert slots == ["20261129T0200", "20261129T0200", "20261130T0200"]
    assert submission_id("night ly/captions", slots[0]) == "vlb-night-ly-captions-20261129T0200"


@pytest.mark.parametrize("bad", ["0 2 * *", "61 * * * *", "* 24 * * *", "a b c d e", "0 0 0 * *", "*/0 * * * *"])
def test_bad_cron_is_a_typed_error(bad):
    with pytest.raises(SubmissionError, match="schedule"):
        parse_cron(bad)


def test_run_lock_refuses_a_second_holder_and_frees_on_exit(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from vlbatch.jobs.scheduling import run_lock\n"
         f"with run_lock('nightly', Path({str(tmp_path)!r})):\n print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OverlapError, match=f"pid {holder.pid}"):
            with run_lock("nightly", tmp_path):
                pass
        with run_lock("other-job", tmp_path):  # other jobs are not blocked
            pass
    finally:
        holder.communicate("", timeout=30)
    with run_lock("nightly", tmp_path) as path:  # released when the holder exited
        assert path.read_text().strip() == str(__import__("os").getpid())


def test_cli_run_refuses_overlap_before_starting_ray(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2)
    locks = tmp_path / "locks"
    with run_lock("nightly", locks):
        r = vlbatch("run", str(cfg), "--name", "nightly", "--lock-dir", str(locks), "--address", "127.0.0.1:1")
    assert r.returncode == EXIT_OVERLAP, r.stderr
    assert "already running" in r.stderr and "not started" in r.stderr


def test_spec_entrypoint_runtime_env_and_run_id(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2)
    spec = build_spec(cfg, workdir=tmp_path / "wd", name="cap", slot="20261129T0200",
                      overrides=["sampling.max_tokens=3"], env={"A": "1"})
    assert spec.submission_id == "vlb-cap-20261129T0200"
    assert spec.run_id == spec.submission_id  # scheduled: one output per slot
    argv = shlex.split(spec.entrypoint())
    assert argv[:5] == ["python", "-m", "vlbatch.jobs.cli", "run", "job.yaml"] and "--no-lock" in argv
    assert argv[-2:] == ["--set", "output.run_id=vlb-cap-20261129T0200"] and "sampling.max_tokens=3" in argv
    env = spec.runtime_env()
    assert env["working_dir"] == str((tmp_path / "wd").resolve()) and ".git" in env["excludes"]
    assert env["env_vars"]["A"] == "1" and env["env_vars"]["VLBATCH_SUBMISSION_ROOT"] == spec.submission_id
    meta = spec.metadata()
    assert all(isinstance(v, str) for v in meta.values()) and json.loads(meta["overrides"]) == ["sampling.max_tokens=3"]
    adhoc = build_spec(cfg, workdir=tmp_path / "wd", name="cap")  # no slot: the config's own run id
    from vlbatch.pipeline.config import load_config

    assert adhoc.run_id == load_config(cfg).resolved_run_id()
    assert adhoc.submission_id.startswith("vlb-cap-2")


def test_spec_rejects_config_outside_workdir(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path / "a", tiny_ckpt("dense"), n_images=1)
    (tmp_path / "b").mkdir()
    with pytest.raises(SubmissionError, match="outside the working directory"):
        build_spec(cfg, workdir=tmp_path / "b", slot="x")


@pytest.mark.slow
def test_cli_validate_exit_codes(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path, tiny_ckpt("dense"), n_images=1)
    ok = vlbatch("validate", str(cfg), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["config"]["model"]["path"] == str(tiny_ckpt("dense"))
    bad = vlbatch("validate", str(cfg), "--set", "video.backend=ffmpeg", "--set", "sampling.top_p=0")
    assert bad.returncode == EXIT_USAGE
    assert "video.backend" in bad.stderr and "sampling.top_p" in bad.stderr
    sub = vlbatch("submit", str(cfg), "--workdir", str(tmp_path), "--set", "nope.x=1", "--address", "http://127.0.0.1:1")
    assert sub.returncode == EXIT_USAGE and "nope" in sub.stderr  # invalid config: refused before any network call
    env = vlbatch("submit", str(cfg), "--workdir", str(tmp_path), "--env", "NOEQUALS", "--address", "http://127.0.0.1:1")
    assert env.returncode == EXIT_USAGE and "NAME=VALUE" in env.stderr
