"""Issue 31, item 10 (console): after an actor is killed, Ray's `(raylet)` lines (ANSI-coloured, printed
to stdout by the driver's error listener) stay off stdout under `quiet_ray`, and land in the driver's
log file without colour codes. A real Ray (the session's, tests/conftest.py), a real SIGKILL of the actor's process."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from vlbatch.jobs.connect import quiet_ray
from vlbatch.jobs.run_logs import driver_stderr_path

WAIT_S = 90  # the listener's line arrives within seconds; the wait ends on it, not on time


@pytest.mark.ray
def test_raylet_lines_after_an_actor_kill_stay_off_stdout(capfd, tmp_path, ray_cluster):
    """On the session's Ray (connected before the block, as a driver that joined: Ray's error listener
    writes to whatever sys.stdout is when its line comes)."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class Victim:
        def pid(self) -> int:
            return os.getpid()

    log = driver_stderr_path(tmp_path)
    with quiet_ray(driver_stderr_path(tmp_path), verbose=False):
        a = Victim.remote()
        os.kill(ray.get(a.pid.remote()), signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.pid.remote())
        deadline = time.monotonic() + WAIT_S
        while "(raylet)" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        print("result line")
    out = capfd.readouterr().out
    text = log.read_text()
    assert "(raylet)" in text and "\x1b[" not in text  # kept for the user, in plain text
    assert "(raylet)" not in out and "\x1b[" not in out and "result line" in out


def test_worker_log_lines_flushed_at_shutdown_stay_off_the_terminal(capfd, tmp_path):
    """Issue 50: after a Ctrl-C, `ray.shutdown` prints the lines its log deduplicator held (`(raylet) The
    actor is dead ... [repeated 15x across cluster]`) on the driver's own thread, to sys.stdout and
    sys.stderr. They are Ray's worker-log lines, recognised by their prefix: into the log, not the terminal;
    our own lines pass. (No Ray here: the lines are printed as Ray's `print_worker_logs` prints them.)"""
    held = ["\x1b[36m(raylet)\x1b[0m The actor is dead because it was killed by `ray.kill`. "
            "\x1b[32m[repeated 15x across cluster]\x1b[0m",
            "\x1b[33m(MapWorker(MapBatches(ModelStage)) pid=4242, ip=10.0.0.7)\x1b[0m Traceback (most recent call last):",
            "\x1b[36m(autoscaler +3s)\x1b[0m Adding 1 node(s) of type gpu-workers."]
    with quiet_ray(driver_stderr_path(tmp_path), verbose=False):
        print(held[0])
        print(held[1], file=sys.stderr)
        print(held[2])
        print("[vlbatch] interrupted: 3 rows committed in out/x/; rerun the same command to resume")
        print("(a note of ours) stays")
    captured = capfd.readouterr()
    assert captured.out == ("[vlbatch] interrupted: 3 rows committed in out/x/; rerun the same command to resume\n"
                            "(a note of ours) stays\n")
    assert captured.err == ""
    text = driver_stderr_path(tmp_path).read_text()
    assert "[repeated 15x across cluster]" in text and "pid=4242" in text and "\x1b[" not in text
