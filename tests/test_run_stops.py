"""Clean stops of `vlbatch run` (issue 33 "Clean stops"): Ctrl-C (SIGINT to the process group, as a
terminal sends it) and a scheduler's SIGTERM mid-run print one line, "interrupted: N rows committed
in <dir>; rerun the same command to resume", no traceback, exit 130 / 143; nothing staged is left
beside the parts; the rerun resumes exactly (the N rows skipped, the rest computed, each id once).

Mid-run is an event the test controls, never a timing: the media come from a loopback HTTP server
that holds the last image until the test lets it go, so the run is certainly still running (held
in that read) when the test, having seen a first part file committed, sends the signal."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from held_http import held_manifest
from test_jobs_support import REPO, TEST_ENV, read_output
from test_metrics_busy import Lines

N_FREE = 10  # images served at once; the held one comes after them in the manifest


@pytest.fixture()
def held_job(tmp_path, tiny_ckpt):
    manifest, server = held_manifest(tmp_path, N_FREE)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {tiny_ckpt('dense')}, dtype: float32, device: cpu}}
input: {{uri: {manifest}, format: jsonl}}
sampling: {{max_tokens: 4}}
image: {{max_pixels: 12544}}
resources:
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}}
  model: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}}
  write: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}}
output: {{uri: {tmp_path / 'out'}, part_rows: 2}}
ray: {{progress_interval_s: 1}}
""")
    yield cfg, server
    server.close()


def _start(cfg, home, *, local_ray: bool) -> subprocess.Popen:
    """`vlbatch run` in a process group of its own: with a new local Ray of its own (`local_ray`: the stopped
    run, whose Ray shut down takes every writer with it, so the run tidies its directory: `_tmp/` dropped; a
    joined cluster's writers may still be alive, and it is left), else joining the session's Ray
    (RAY_ADDRESS, tests/conftest.py: the rerun)."""
    env = dict(os.environ, **TEST_ENV, HOME=str(home))
    if local_ray:
        env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--no-lock"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)


def _first_part(out_dir, proc, deadline_s=600):
    """Wait until a part file is committed (the event the signal waits for)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if any(out_dir.glob("*/part-*.parquet")):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before committing a part: {proc.communicate()}")
        time.sleep(0.2)
    raise AssertionError("no part file committed")


@pytest.mark.ray
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_stops_cleanly_and_the_rerun_resumes_exactly(held_job, tmp_path, signum, code):
    cfg, server = held_job
    out_dir = tmp_path / "out"
    home = tmp_path / "home"
    home.mkdir()
    proc = _start(cfg, home, local_ray=True)
    try:
        err = Lines(proc.stderr)
        _first_part(out_dir, proc)
        # and the driver has counted committed rows (its progress line): the stopped attempt's rows (item 12)
        assert err.wait_for(lambda line: re.search(r"committed [1-9]\d*/", line) is not None), "".join(err.lines)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # Ctrl-C at a terminal: the whole foreground process group
        else:
            os.kill(proc.pid, signum)  # a scheduler: the main process
        stdout, _ = proc.communicate(timeout=300)
        err.wait_for(lambda line: False)  # to its end
        stderr = "".join(err.lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, stdout + stderr
    assert "Traceback" not in stdout + stderr and "Error" not in stderr, stdout + stderr
    m = re.fullmatch(r"\[vlbatch\] interrupted: (\d+) rows committed in (\S+)/; rerun the same command to resume",
                     stdout.splitlines()[-1])
    assert m, stdout
    run_dir = out_dir / os.path.basename(m.group(2))
    assert run_dir.is_dir() and sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("part-")) == [
        "_fingerprint.json", "_summary.json"]
    before = read_output(run_dir)
    n = int(m.group(1))
    assert 1 <= n == len(before) < N_FREE + 1  # the held image was never read
    # issue 60 item 12: the stopped call is an attempt of its own, its rows those its writers took
    [a1] = json.loads((run_dir / "_summary.json").read_text())["attempts"]
    assert a1["ended"] == "interrupted" and 1 <= a1["rows"] == a1["ok"] <= n and a1["skipped"] == 0, a1
    parts = {p.name: p.read_bytes() for p in run_dir.glob("part-*.parquet")}

    server.release.set()  # the rerun reads everything
    again = _start(cfg, home, local_ray=False)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stdout + stderr
    assert re.search(rf"done: {N_FREE + 1 - n} ok, 0 error, {n} skipped", stdout), stdout
    rows = read_output(run_dir)
    assert len(rows) == len({r["id"] for r in rows}) == N_FREE + 1
    assert all(r["status"] == "ok" for r in rows)
    assert all((run_dir / name).read_bytes() == data for name, data in parts.items())  # kept as they were
    summary = json.loads((run_dir / "_summary.json").read_text())
    assert [a["attempt"] for a in summary["attempts"]] == [1, 2] and summary["attempts"][0] == a1, summary
    a2 = summary["attempts"][1]
    assert (a2["ended"], a2["rows"], a2["skipped"]) == ("finished", N_FREE + 1 - n, n), a2
    tl = summary["run_timeline"]  # the throughput plot's: both calls, one after the other
    assert sum(b[tl["fields"].index("rows")] for b in tl["buckets"]) == a1["rows"] + a2["rows"], tl
    shown = subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "inspect", str(run_dir), "--sample", "0"],
                           capture_output=True, text=True, env=dict(os.environ, **TEST_ENV), cwd=REPO, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "2 attempts" in shown.stdout and re.search(r"^\s+1  .*  interrupted$", shown.stdout, re.M), shown.stdout
