"""The reaper of a run's own local Ray: when the driver ends, however it ends (SIGKILL included), the
processes of the Ray session it started end too.

`ray.init` starting a new local Ray makes the driver the parent of Ray's head processes (GCS, raylet,
dashboard, log monitor, the dashboard and runtime-env agents) and, through the raylet, of its workers.
Ray ties only some of them to the driver's life; after a SIGKILL of the driver its dashboard and
runtime-env agents were found alive 15 s later (issue 48). So `vlbatch run` marks the session: before
`ray.init` it sets ``VLBATCH_RAY_OWNER=<token>`` (`MARK_VAR`) in its environment, which every process of
the session inherits (read back from ``/proc/<pid>/environ``, fixed at exec), and starts this module as
a child in its own session (so a terminal's Ctrl-C does not reach it) holding the read end of a pipe
whose write end only the driver holds (close-on-exec: no Ray process inherits it). The driver's death,
or the end of the run (`reaped_ray` closing it after `ray.shutdown`), ends the pipe. Meanwhile the
reaper notes, every `WATCH_S`, the driver's descendants and the processes carrying the token, with
theirs (`watch`): a process's title set by setproctitle, as Ray sets `ray::DashboardAgent`, overwrites
the start of its environment's memory, and with it, at times, the token. At EOF it sends SIGTERM to
every process of this user carrying the token or noted (pid and start time: a reused pid is not noted),
and to their descendants, gives them `GRACE_S` to exit, SIGKILLs the rest, and scans again until none is
left (a raylet may start a worker meanwhile), at most `ROUNDS` times.

What is left after it: nothing of the session's processes; Ray's session folder (logs, sockets) under
its temp dir stays, as after any Ray run. Linux only (it reads /proc); elsewhere nothing is started.
A joined cluster's processes are never touched: the reaper is started only for a new local Ray.

    python -m vlbatch.jobs.reaper TOKEN DRIVER_PID    # waits for EOF on stdin, then reaps the session
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

MARK_VAR = "VLBATCH_RAY_OWNER"
GRACE_S = 5.0  # SIGTERM -> SIGKILL
ROUNDS = 20  # scans at most (each after a kill round)
WATCH_S = 0.5  # how often the session's processes are noted while the driver lives
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
        reaper = subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.reaper", token, str(os.getpid())],
                                  stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
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


@dataclass(frozen=True)
class _Proc:
    """One live process of this user, from /proc: `start` (clock ticks after boot) tells a reused pid."""

    pid: int
    ppid: int
    start: int
    marked: bool  # its environment holds MARK_VAR=token


def _scan(token: str) -> dict[int, _Proc]:
    """This user's live processes (this one, zombies and the unreadable excluded)."""
    entry = f"{MARK_VAR}={token}".encode()
    me, uid, out = os.getpid(), os.getuid(), {}
    for d in os.scandir("/proc"):
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if os.stat(d.path).st_uid != uid:
                continue
            with open(os.path.join(d.path, "stat"), "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()  # after the name, which may hold spaces
            with open(os.path.join(d.path, "environ"), "rb") as f:
                env = f.read()
        except OSError:  # gone meanwhile, or not readable
            continue
        if fields[0] != b"Z":
            out[int(d.name)] = _Proc(int(d.name), int(fields[1]), int(fields[19]), entry in env.split(b"\0"))
    return out


def _family(procs: dict[int, _Proc], known: frozenset[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    """(pid, start) of the session: `known` processes still alive, marked ones, and all their descendants.
    The tree matters because a process may hide the mark: setproctitle (Ray's `ray::DashboardAgent`, ...)
    overwrites the start of its environment's memory, which is what /proc/<pid>/environ reads."""
    family = {p.pid for p in procs.values() if p.marked or (p.pid, p.start) in known}
    grew = True
    while grew:
        children = {p.pid for p in procs.values() if p.ppid in family} - family
        family |= children
        grew = bool(children)
    return frozenset((pid, procs[pid].start) for pid in family)


def session_pids(token: str, known: frozenset[tuple[int, int]] = frozenset()) -> list[int]:
    """The session's live processes: those marked with ``MARK_VAR=token``, those in `known` (pid, start)
    still alive, and their descendants (this process excluded)."""
    return sorted(pid for pid, _ in _family(_scan(token), known))


def watch(token: str, stream, root: int | None, interval_s: float = WATCH_S) -> frozenset[tuple[int, int]]:
    """Until `stream` (the pipe's read end) reaches EOF, note the session's processes every `interval_s`:
    the driver `root`'s descendants and the marked, with theirs. Noted while their parents live, they are
    found after the driver's death too, when they are the init process's children, mark hidden or not."""
    procs = _scan(token)
    root_key = frozenset({(root, procs[root].start)}) if root in procs else frozenset()
    known = frozenset()
    while True:
        readable, _, _ = select.select([stream], [], [], interval_s)
        if readable and not os.read(stream.fileno(), 4096):  # nothing is ever written: b"" at EOF
            return known
        known = (known | _family(_scan(token), known | root_key)) - root_key  # never the driver itself


def reap(token: str, known: frozenset[tuple[int, int]] = frozenset(), grace_s: float = GRACE_S) -> None:
    """SIGTERM the session's processes, SIGKILL those still there after `grace_s`, until none is left."""
    for _ in range(ROUNDS):
        pids = session_pids(token, known)
        if not pids:
            return
        _signal(pids, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while (alive := set(pids) & set(session_pids(token, known))) and time.monotonic() < end:
            time.sleep(0.1)
        _signal(sorted(alive), signal.SIGKILL)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's stop (jobs/stops.py) ends the pipe itself
    token = argv[0]
    driver = int(argv[1]) if len(argv) > 1 else None
    root = driver if driver == os.getppid() else None  # else the driver died already (its pid reads 1 or a
    known = frozenset()                                  # subreaper's): no tree to note, the mark only
    with contextlib.suppress(OSError):
        known = watch(token, sys.stdin, root)
    reap(token, known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
