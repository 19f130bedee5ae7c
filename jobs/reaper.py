"""The reaper of a run's own local Ray: when the driver ends, however it ends (SIGKILL included), the
processes of the Ray session it started end too.

`ray.init` starting a new local Ray makes the driver the parent of Ray's head processes (GCS, raylet,
dashboard, log monitor, the dashboard and runtime-env agents) and, through the raylet, of its workers.
Ray ties only some of them to the driver's life; after a SIGKILL of the driver its dashboard and
runtime-env agents were found alive 15 s later (issue 48). So `vlbatch run` marks the session: before
`ray.init` it sets ``VLBATCH_RAY_OWNER=<token>`` (`MARK_VAR`) in its environment, which every process of
the session inherits (read back from ``/proc/<pid>/environ``: fixed at exec, untouched by Ray's process
titles), and starts this module as a child in its own session (so a terminal's Ctrl-C does not reach
it) holding the read end of a pipe whose write end only the driver holds (close-on-exec: no Ray process
inherits it). The driver's death, or the end of the run (`reaped_ray` closing it after `ray.shutdown`),
ends the pipe; the reaper then sends SIGTERM to every process of this user carrying the token, gives
them `GRACE_S` to exit, SIGKILLs the rest, and scans again until none is left (a raylet may start a
worker meanwhile), at most `ROUNDS` times.

What is left after it: nothing of the session's processes; Ray's session folder (logs, sockets) under
its temp dir stays, as after any Ray run. Linux only (it reads /proc); elsewhere nothing is started.
A joined cluster's processes are never touched: the reaper is started only for a new local Ray.

    python -m vlbatch.jobs.reaper TOKEN    # waits for EOF on stdin, then reaps TOKEN's processes
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

MARK_VAR = "VLBATCH_RAY_OWNER"
GRACE_S = 5.0  # SIGTERM -> SIGKILL
ROUNDS = 20  # scans at most (each after a kill round)
CLOSE_WAIT_S = 4 * GRACE_S  # how long the driver waits for the reaper after a normal end


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/environ")


@contextlib.contextmanager
def reaped_ray() -> Iterator[None]:
    """For the block (which starts a new local Ray and shuts it down): the session is marked and a
    reaper waits for this process to end (module docstring). On leaving the block the reaper is told
    to sweep what `ray.shutdown` left, and waited for (bounded)."""
    if not supported():
        yield
        return
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    read_end, write_end = os.pipe()  # both close-on-exec; the reaper gets the read end as its stdin
    try:
        reaper = subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.reaper", token], stdin=read_end,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read_end)
    saved = os.environ.get(MARK_VAR)
    os.environ[MARK_VAR] = token  # inherited by every process `ray.init` starts, and theirs
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(MARK_VAR, None)
        else:
            os.environ[MARK_VAR] = saved
        os.close(write_end)  # EOF: the reaper sweeps now
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(timeout=CLOSE_WAIT_S)  # else it finishes on its own, reparented


def session_pids(token: str) -> list[int]:
    """This user's live processes whose environment holds ``MARK_VAR=token`` (this process excluded;
    a zombie's environment reads empty)."""
    entry = f"{MARK_VAR}={token}".encode()
    me, uid, out = os.getpid(), os.getuid(), []
    for d in os.scandir("/proc"):
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if os.stat(d.path).st_uid != uid:
                continue
            with open(os.path.join(d.path, "environ"), "rb") as f:
                env = f.read()
        except OSError:  # gone meanwhile, or not readable
            continue
        if entry in env.split(b"\0"):
            out.append(int(d.name))
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap(token: str, grace_s: float = GRACE_S) -> None:
    """SIGTERM the session's processes, SIGKILL those still there after `grace_s`, until none is left."""
    for _ in range(ROUNDS):
        pids = session_pids(token)
        if not pids:
            return
        _signal(pids, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while (alive := set(pids) & set(session_pids(token))) and time.monotonic() < end:
            time.sleep(0.1)
        _signal(sorted(alive), signal.SIGKILL)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's stop (jobs/stops.py) ends the pipe itself
    token = argv[0]
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):  # nothing is ever written: returns b"" when the driver's end closes
            pass
    reap(token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
