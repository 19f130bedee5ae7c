"""Walk the calls of `vlbatch validate` and of `vlbatch run`'s start-up, and count the rooms (issue 49).

    python scripts/walk_calls.py configs/demo.yaml [--set key=value ...]

Runs in this process, under `sys.setprofile` (main thread only):
1. `vlbatch validate`'s path (`jobs/commands.cmd_validate`);
2. `vlbatch run`'s path (`jobs/local.run_local`) up to, not into, the Ray graph's execution. `run_local`
   cannot be stopped before Ray (Ray is started, as a run starts it, and shut down again), so this script
   patches the graph-run call (`_stream_graph` of the module holding `run_job`: `pipeline/graph.py`, or
   `pipeline/runner.py` on older trees) to raise `_Stop` as it is entered, which ends the walk: what runs after
   it (the run's teardown, Ray's shutdown, as `_Stop` unwinds) is not start-up and is not counted.

A room is a module of `vlbatch.jobs` or `vlbatch.pipeline` (the flow; the operators they call are its
leaves, not rooms); the walk is the sequence of rooms entered: a move is a call (a profile `call` event)
into a room from code of another module, other than the room the walk is in (a call within one module,
or from a library back into the room the walk is in, is no move; module bodies run by an
import, and every call made while an import runs (a dataclass's generated `__init__`, pydantic building a
schema, a registry read at class definition), are not counted, since what is imported already depends on
the process; nor is a generator's resumption (the profile reports each `next()` of a generator, and the
exit of a `with` block of a `contextlib.contextmanager`, as a call into the generator's module: a reader
follows the first entry, not each resume). `--count-imports` / `--count-resumes`: counted as the first
version of this script did (both: its figures). Printed per path: rooms
(distinct modules entered), moves, returns (moves into a room entered before, i.e. already left once) and how many times
`sink` (`plan/sink.py`), `fingerprint` and `preflight` are entered (moves into a module whose last dotted part
is that name). The demo config's media are written first when missing
(`pipeline/demo.prepare_demo`, as `vlbatch demo` does).
"""
from __future__ import annotations

import argparse
import contextlib
import dis
import importlib
import inspect
import io
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

WATCHED = ("sink", "fingerprint", "preflight")
ROOMS = ("vlbatch.jobs.", "vlbatch.pipeline.")  # the flow's modules; what they call below (operators) is not a room


class _Stop(BaseException):
    """Raised where the Ray graph would start running (not an Exception: nothing on the way catches it)."""


class Walk:
    """The modules entered by calls while active: `rooms`, `moves`, `returns`, `entered`."""

    def __init__(self, count_imports: bool = False, count_resumes: bool = False) -> None:
        self.seq: list[str] = []
        self.count_imports, self.count_resumes = count_imports, count_resumes
        self.importing = 0  # module bodies running now (nested imports)

    def profile(self, frame, event, arg) -> None:
        if frame.f_code.co_name == "<module>":  # an import's module body starts or ends
            self.importing += {"call": 1, "return": -1}.get(event, 0)
            return
        if event != "call" or (self.importing and not self.count_imports):
            return
        if not self.count_resumes and _resumed(frame):
            return
        mod = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        # a call into a room from another module, not the room the walk is in already: one move
        if mod.startswith(ROOMS) and mod != caller and (not self.seq or self.seq[-1] != mod):
            self.seq.append(mod)

    def figures(self) -> dict:
        seen, returns = set(), 0
        for mod in self.seq:
            returns += mod in seen
            seen.add(mod)
        entered = Counter(m.rsplit(".", 1)[-1] for m in self.seq)
        return {"rooms": len(seen), "moves": len(self.seq), "returns": returns,
                **{f"{w} entered": entered.get(w, 0) for w in WATCHED}}


_RESUME = dis.opmap.get("RESUME")  # Python >= 3.11: a frame's first entry stops at `RESUME 0`; a resume after a
# yield / await at `RESUME n>0`, and one by `throw()` (a `with` block left by an exception) at the yield itself


def _resumed(frame) -> bool:
    """A generator (or coroutine) frame resumed after a yield, not entered for the first time."""
    if _RESUME is None or not frame.f_code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE
                                                       | inspect.CO_ASYNC_GENERATOR):
        return False
    code, at = frame.f_code.co_code, frame.f_lasti
    return 0 <= at < len(code) - 1 and not (code[at] == _RESUME and code[at + 1] == 0)


@contextlib.contextmanager
def walking(walk: Walk):
    sys.setprofile(walk.profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def _graph_module():
    for name in ("vlbatch.pipeline.graph", "vlbatch.pipeline.runner"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "_stream_graph"):
            return mod
    raise SystemExit("no module with _stream_graph (pipeline/graph.py or pipeline/runner.py)")


def validate_walk(config: str, overrides: list[str], out_uri: str, **counting: bool) -> Walk:
    from vlbatch.jobs.commands import cmd_validate

    args = argparse.Namespace(config=config, overrides=[*overrides, f"output.uri={out_uri}"], address=None,
                              json=False, allow_config_change=False)
    walk = Walk(**counting)
    with walking(walk), contextlib.redirect_stdout(io.StringIO()):
        cmd_validate(args)
    return walk


def run_walk(config: str, overrides: list[str], out_uri: str, **counting: bool) -> Walk:
    from vlbatch.jobs.local import run_local

    graph = _graph_module()

    def stop(*_a, **_k):
        sys.setprofile(None)  # the walk ends here: the teardown `_Stop` unwinds through is not counted
        raise _Stop

    real, graph._stream_graph = graph._stream_graph, stop
    walk = Walk(**counting)
    try:
        with walking(walk), contextlib.redirect_stdout(io.StringIO()):
            run_local(config, [*overrides, f"output.uri={out_uri}"], use_lock=False)
    except _Stop:
        pass
    finally:
        graph._stream_graph = real
        import ray

        if ray.is_initialized():
            ray.shutdown()
    return walk


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--sequence", action="store_true", help="print each path's sequence of modules too")
    p.add_argument("--count-imports", action="store_true", help="count the calls made while an import runs too "
                                                                 "(the script's first definition)")
    p.add_argument("--count-resumes", action="store_true", help="count each resume of a generator as a call too "
                                                                 "(the script's first definition)")
    args = p.parse_args(argv)
    if Path(args.config).name == "demo.yaml":
        from vlbatch.pipeline.demo import prepare_demo

        prepare_demo(Path(args.config).resolve().parents[1] / "out" / "demo")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with tempfile.TemporaryDirectory(prefix="walk-calls-") as out:
        counting = {"count_imports": args.count_imports, "count_resumes": args.count_resumes}
        walks = {"validate": validate_walk(args.config, args.overrides, out, **counting),
                 "run (up to the graph)": run_walk(args.config, args.overrides, out, **counting)}
    for name, walk in walks.items():
        figures = ", ".join(f"{k} {v}" for k, v in walk.figures().items())
        print(f"{name}: {figures}")
        if args.sequence:
            print("  " + " -> ".join(m.removeprefix("vlbatch.") for m in walk.seq))
    return 0


if __name__ == "__main__":
    sys.exit(main())
