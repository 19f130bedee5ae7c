"""Clean stops of `vlbatch run`: Ctrl-C (SIGINT) and a scheduler's SIGTERM.

`stop_signals()` turns either signal into `Interrupted` (a BaseException, like
KeyboardInterrupt, so no `except Exception` in Ray or in our stages swallows it) raised in the
main thread; Ray's own SIGTERM handler (installed by `ray.init`: `sys.exit`) is replaced while
the block runs. After Ray is shut down, `finish_interrupted` makes the run directory tidy and
says what it holds, in one line, no traceback:

    [vlbatch] interrupted: 120 rows committed in out/run-1a2b/; rerun the same command to resume

and the exit code is 128 + the signal (130 for SIGINT, 143 for SIGTERM), at any moment of the run
(`jobs/local.py`: armed from the config's load to the last line): during the start-up checks (0 rows,
nothing touched), while Ray starts (Ray's own SIGTERM handlers then: `jobs/connect.py`), while
the actors start and the model loads, mid-run, while the last rows are published, during Ray's
shutdown (`signals_deferred`: the shutdown ends first) and after it. Before the config is read the
CLI says `vlbatch: interrupted` with the same codes (no run directory to name yet).

Tidy: on a local Ray started for the run the writers died with it, so what they had staged
(batches whose calls returned, `_tmp/staged/`) is published now (`sink.seal`: exactly once,
already-committed ids skipped) and `_tmp/` is dropped (`sink.prepare`, which every start runs
anyway); nothing half-written stays beside the parts. On a joined cluster the writers may still
be alive for a moment, so `_tmp/` is left to the rerun (which drops it: staged batches are only
ever read back by `seal`, never by a listing of the parts).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, a way of stopping, not an error
    """SIGINT or SIGTERM reached the run; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interruption(exc: BaseException) -> Interrupted | None:
    """The `Interrupted` that `exc` was raised while handling (its context or cause, at any depth): a
    library's cleanup that failed while the signal unwound the run (Ray's, as a model actor was compiling a
    grammar, said "the run failed: Interrupted: SIGTERM"). The run was stopped: it ends as a stop does."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not s for s in seen):
        if isinstance(e, Interrupted):
            return e
        seen.append(e)
        e = e.__cause__ or e.__context__
    return None


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def arm() -> None:
    """SIGINT and SIGTERM raise `Interrupted` from now on. Called again once Ray is connected:
    `ray.init` installs its own SIGTERM handlers (Python's `sys.exit`, and the C++ core worker's
    failure-signal handler, which dumps a stack and aborts the driver: exit -6)."""
    if _main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _raise)


def _main_thread() -> bool:
    """Signal handlers can be set only there (an in-process caller on another thread keeps its own)."""
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` in the main thread inside the block (call it from the
    main thread: Python delivers signals only there; `arm()` again after `ray.init`)."""
    if not _main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    arm()
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """The block (Ray's shutdown after the run: seconds) runs to its end whatever signal comes; the
    signals that came are listed, in order, in the yielded list, for the caller to act on after the
    block (`raise Interrupted(noted[0])`): a signal then is neither lost (exit 0) nor a traceback."""
    noted: list[int] = []
    if not _main_thread():
        yield noted
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, lambda signum, frame: noted.append(signum))
    try:
        yield noted
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """A second Ctrl-C while the run is being tidied up is ignored (it takes seconds)."""
    if not _main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def finish_interrupted(config: Any, *, writers_gone: bool) -> str:
    """Tidy the run directory (see the module docstring) and return the one line to print.
    `writers_gone`: Ray (and with it every write actor) is shut down."""
    from vlbatch.operators.storage import join
    from vlbatch.pipeline.plan.sink import open_sink

    run_uri = join(config.output.uri.rstrip("/"), config.resolved_run_id())
    sink = open_sink(config, run_uri)
    if writers_gone and _exists(sink):
        policy = config.output.roll_policy()
        sink.seal(policy.target_rows, policy.target_bytes)
        sink.prepare()  # drops _tmp/ (a killed writer's half-written temp files)
        sink.finish()
    rows = sum(sink.index().status_counts.values())
    return (f"[vlbatch] interrupted: {rows} rows committed in {run_uri.rstrip('/')}/; "
            "rerun the same command to resume")


def _exists(sink: Any) -> bool:
    """The run directory exists (an interrupt before the run opened it: nothing to tidy, nothing made)."""
    fs, root = getattr(sink, "fs", None), getattr(sink, "root", None)
    return fs is None or root is None or bool(fs.exists(root))
