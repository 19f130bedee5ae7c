"""Issue 31, item 10 (console): after an actor is killed, Ray's `(raylet)` lines (ANSI-coloured, printed
to stdout by the driver's error listener) stay off stdout under `quiet_ray`, and land in the driver's
log file without colour codes. A real local Ray (its own), a real SIGKILL of the actor's process."""
from __future__ import annotations

import os
import signal
import time

import pytest

from vlbatch.jobs.connect import driver_stderr_path, quiet_ray

WAIT_S = 90  # the listener's line arrives within seconds; the wait ends on it, not on time


def test_raylet_lines_after_an_actor_kill_stay_off_stdout(capfd):
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class Victim:
        def pid(self) -> int:
            return os.getpid()

    job = f"console-test-{os.getpid()}"
    log = driver_stderr_path(job)
    ray.shutdown()
    with quiet_ray(job, verbose=False):
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        try:
            a = Victim.remote()
            os.kill(ray.get(a.pid.remote()), signal.SIGKILL)
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(a.pid.remote())
            deadline = time.monotonic() + WAIT_S
            while "(raylet)" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            print("result line")
        finally:
            ray.shutdown()
    out = capfd.readouterr().out
    text = log.read_text()
    assert "(raylet)" in text and "\x1b[" not in text  # kept for the user, in plain text
    assert "(raylet)" not in out and "\x1b[" not in out and "result line" in out
