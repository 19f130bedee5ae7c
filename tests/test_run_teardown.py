"""Issue 48 item 10, end to end (a real `vlbatch run` each): a full disk under the output ends the run with
`no space left on <path>` (joining the session's Ray, tests/conftest.py), and a SIGKILLed driver leaves no
process of its Ray session behind (a new local Ray of the run's own: its reaping is the subject).

Real parts: a tmpfs mounted for the test (CI runs as root; skipped, saying why, where mounting is not
allowed), real Ray, the real CLI. The unit-level checks are in tests/test_messages_issue48.py."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from held_http import held_manifest
from test_jobs_support import REPO, TEST_ENV, write_job

pytestmark = pytest.mark.ray

PAGE = 4096


def _env(*, local_ray: bool = False, **extra: str) -> dict:
    """A `vlbatch run` child's: it joins the session's Ray (RAY_ADDRESS, tests/conftest.py) unless `local_ray`."""
    env = dict(os.environ, **TEST_ENV, VLBATCH_SIMD="off", **extra)
    if local_ray:
        env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs at tmp_path/fs, unmounted after the test."""
    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_says_no_space_left_on_the_folder(tmp_path, tiny_ckpt, small_fs):
    """The output on a tmpfs with two pages free: `_fingerprint.json` takes one, the first staged part
    (over a page: its rows carry a 3000-character prompt of random letters) does not fit. Today the
    last line is `ObjectRefStreamEndOfStreamError: ` (the cause only in the log file)."""
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2, write_batch=2, output=small_fs / "out")
    letters = np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyz"), 3000)
    cfg.write_text(cfg.read_text().replace("prompt: Describe.", f"prompt: {''.join(letters)}"))
    st = os.statvfs(small_fs)
    (small_fs / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 2 * PAGE))
    r = subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--no-lock", "--name",
                        f"full-{os.getpid()}"], capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1, r.stdout + r.stderr
    assert last.startswith("vlbatch: the write stage failed"), last
    assert f"no space left on {small_fs}/out/" in last and "ObjectRefStreamEndOfStream" not in last, last
    assert "Traceback" not in r.stdout + r.stderr
    assert not list(small_fs.rglob("*.vlbatch-tmp"))  # the failed write took its temp file with it


def _procs() -> dict[int, tuple[int, int, bytes, bytes]]:
    """{pid: (ppid, start time, environment, command line)} of the live processes (zombies left out: a
    zombie holds nothing, its parent has not reaped it yet)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            cmd = (d / "cmdline").read_bytes()
            fields = (d / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if fields[0] != "Z":
            found[int(d.name)] = (int(fields[1]), int(fields[19]), env, cmd)
    return found


def _session_pids(mark: str, noted: dict[int, int] | None = None) -> dict[int, str]:
    """{pid: name} of the live processes of the session: those whose environment or command line holds
    `mark` (the run's RAY_TMPDIR, inherited by every process of its Ray session), those in `noted`
    ({pid: start time}) still alive, and the descendants of all of them. The tree matters: a process
    titled by setproctitle (Ray's `ray::DashboardAgent`) overwrites the start of its environment's memory,
    which /proc/<pid>/environ reads, the mark with it at times."""
    procs = _procs()
    family = {pid for pid, (_, start, env, cmd) in procs.items()
              if mark.encode() in env or mark.encode() in cmd or (noted or {}).get(pid) == start}
    while children := {pid for pid, (ppid, *_) in procs.items() if ppid in family} - family:
        family |= children
    return {pid: procs[pid][3].replace(b"\0", b" ").decode(errors="replace")[:120] for pid in family}


def _noted(pids) -> dict[int, int]:
    procs = _procs()
    return {pid: procs[pid][1] for pid in pids if pid in procs}


def test_a_killed_driver_leaves_no_process_of_its_ray_session(tmp_path, tiny_ckpt):
    """SIGKILL the driver once it said its model actor is ready (gate on output: by then Ray's dashboard
    and runtime-env agents run), while it waits on a held HTTP read (so it cannot have finished), then
    wait (a bounded poll) until no process of its Ray session remains. The agents' titles (setproctitle)
    overwrite the start of their environment's memory, the reaper's mark with it at times: they are
    found through the process tree (jobs/reaper.py).
    Today Ray's `ray::DashboardAgent` and `ray::RuntimeEnvAgent` outlive it by about a minute: when their
    raylet dies they first report it through the GCS, dead too, and wait out Ray's GCS timeout. The limit
    (30 s) is generous for the reaper (SIGTERM, 5 s grace, SIGKILL) and below that minute. The session is
    the one under the run's own RAY_TMPDIR."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc (Linux) to find the session's processes")
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=1, write_batch=2)
    manifest, server = held_manifest(tmp_path, 2)  # the run waits on hold.png until the test ends: it cannot
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "wd" / "manifest.jsonl"), str(manifest)))  # finish first
    ray_tmp = tempfile.mkdtemp(prefix="vlbk-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    out = (tmp_path / "stdout.log").open("w")
    driver = subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--no-lock", "--name",
                               f"killed-{os.getpid()}"], stdout=out, stderr=subprocess.PIPE, text=True,
                              env=_env(local_ray=True, RAY_TMPDIR=ray_tmp), cwd=REPO)
    noted: dict[int, int] = {}
    try:
        seen = []
        for line in driver.stderr:  # gate on output: the model actor is ready, the graph runs
            seen.append(line)
            if "[vlbatch] running:" in line:
                break
        assert driver.poll() is None, "".join(seen)[-3000:]
        until = time.monotonic() + 60  # Ray's agents (the ones that outlive the driver) start with the node:
        noted = _noted(_session_pids(ray_tmp, {driver.pid: _procs()[driver.pid][1]}))  # wait until they show
        while sum("Agent" in c for c in _session_pids(ray_tmp, noted).values()) < 2 \
                and time.monotonic() < until:  # (an event), bounded
            time.sleep(0.2)
            noted = _noted(_session_pids(ray_tmp, noted))
        before = _session_pids(ray_tmp, noted)
        assert driver.poll() is None, "the run ended before it could be killed"
        driver.kill()
        driver.wait()
        assert sum("Agent" in c for c in before.values()) == 2, before  # the check sees the agents
        deadline = time.monotonic() + 30  # see the docstring; the test goes on as soon as none remain
        while (left := _session_pids(ray_tmp, noted)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"still alive after the driver's SIGKILL: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait()
        for pid in _session_pids(ray_tmp, noted):  # never leave them to the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out.close()
        server.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
