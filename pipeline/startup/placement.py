"""Actors that cannot start on a node (issue 48): recorded, that node avoided, and the run stopped
in one line when no node is left, never a wait for an actor that cannot start.

Every actor pool's class is wrapped (`reporting`): an actor whose constructor raises (the node's
checkpoint cache folder is unwritable, the download fails there, its device is broken) tells the
run's `StartFailures` actor (no CPU, pinned to the driver's node, which lives as long as the run)
its stage, its node and why, then dies. Ray Data replaces an actor that died while starting (up
to `INIT_DEATHS` in a row, `DataContext.max_consecutive_actor_init_deaths`, set by the runner)
and asks the pool's `node_options` for each new actor's options: they keep it off every node
where an actor of that stage failed (a `label_selector` on Ray's `ray.io/node-id` label), so the
run goes on on the nodes that work (a model replica on another GPU node), and
`RunSummary.failed_starts` names each failed stage, node and cause. An actor whose process dies while
it starts (the OOM killer, a signal, a crash: no exception to report) is restarted by Ray in place, and
would die again: `StartFailures` holds each start under way (`begin`, `end`), so the restart finds its
earlier start unfinished, records that node as failed (`DIED_STARTING`) and raises, and the pool goes
on as above instead of restarting it there for ever.

The run stops instead (`ActorStartError` naming the stage, chained from the actor's own error:
one line and a non-zero exit, jobs/failures.py) when
- the failure is the job's own (a `ConfigError`: the checkpoint, the device): it would fail on
  every node alike, so the first one stops the run (as before: exit 2);
- no live node that could hold the stage's actor (its CPUs, GPUs, memory as Ray counts them, in
  total) is left where that stage has not failed: nothing could ever start (exit 8). A cluster
  that might add nodes later (an autoscaler) is not waited for.
Nodes lost mid-run: `pipeline/startup/node_loss.py`.
"""
from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from vlbatch.operators.errors import ActorStartError, ConfigError, stable_message

log = logging.getLogger("vlbatch.pipeline")

NODE_ID_LABEL = "ray.io/node-id"  # Ray's own label on every node
INIT_DEATHS = 8  # actors of one pool that may die while starting in a row before Ray Data fails the run
REPORT_TIMEOUT_S = 30.0  # an actor's report of its failed start (its own error fails the run if it is lost)
DIED_STARTING = ("its process died while the actor started (killed by the OOM killer or a signal, or it crashed; "
                 "see dmesg on that node)")


@dataclass(frozen=True)
class StartFailure:
    """One actor that failed to start: its `stage` (the UDF class name), where (`node_id`,
    `node_ip`) and why (`cause`, one line; `error`: the exception itself when it could be sent)."""

    stage: str
    node_id: str
    node_ip: str
    cause: str
    fatal: bool  # a ConfigError: the job's own, the same on every node
    trace: str = ""  # the constructor's traceback (for the log file)
    error: BaseException | None = None

    def line(self) -> str:
        return f"{self.stage} on node {self.node_ip} ({self.node_id[:8]}): {self.cause}"


class StartFailures:
    """Ray actor: the run's failed actor starts, in order, and the starts under way (by actor id)."""

    def __init__(self):
        self.failures: list[StartFailure] = []
        self.starting: dict[str, tuple[str, str, str]] = {}  # actor id -> (stage, node id, node IP)

    def record(self, failure: StartFailure) -> None:
        self.failures.append(failure)

    def begin(self, actor_id: str, stage: str, node_id: str, node_ip: str) -> StartFailure | None:
        """An actor's start begins. None, or (a start of that actor never ended: its process died, Ray restarted
        it) that start's failure, recorded; the caller then fails its own start."""
        died = self.starting.pop(actor_id, None)
        if died is None:
            self.starting[actor_id] = (stage, node_id, node_ip)
            return None
        failure = StartFailure(*died, DIED_STARTING, fatal=False)
        self.failures.append(failure)
        return failure

    def end(self, actor_id: str) -> None:
        """An actor's start ended (it started, or it raised: `record`)."""
        self.starting.pop(actor_id, None)

    def get(self) -> list[StartFailure]:
        return list(self.failures)


def start_failures():
    """A new `StartFailures` actor for one run, on the driver's node (no CPU)."""
    import ray

    from vlbatch.pipeline.telemetry.meter import driver_node

    return ray.remote(num_cpus=0, scheduling_strategy=driver_node())(StartFailures).remote()


def report_start_failure(handle, stage: str, exc: BaseException) -> None:
    """Called in an actor whose start raised `exc` (before it re-raises): tell the run. Never raises
    (the actor's own error is what matters)."""
    import ray

    ctx = ray.get_runtime_context()
    cause = f"{type(exc).__name__}: {stable_message(' '.join(str(exc).split()))}"[:500]
    trace = "".join(traceback.format_exception(exc))[-8000:]
    where = (stage, ctx.get_node_id(), ray.util.get_node_ip_address(), cause, isinstance(exc, ConfigError), trace)
    for failure in (StartFailure(*where, _bare(exc)), StartFailure(*where)):  # without it if it does not pickle
        try:
            ray.get(handle.record.remote(failure), timeout=REPORT_TIMEOUT_S)
            return
        except Exception as e:  # noqa: BLE001 - the actor's own error still fails or degrades the run
            log.warning("could not report a failed start: %s: %s", type(e).__name__, e)


def begin_start(handle, stage: str) -> StartFailure | None:
    """Called first in an actor's start: `StartFailures.begin` for this actor (None where the call fails: the
    start goes on unwatched)."""
    import ray

    ctx = ray.get_runtime_context()
    try:
        return ray.get(handle.begin.remote(ctx.get_actor_id(), stage, ctx.get_node_id(),
                                           ray.util.get_node_ip_address()), timeout=REPORT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - never keep an actor from starting
        log.warning("could not note an actor's start: %s: %s", type(e).__name__, e)
        return None


def end_start(handle) -> None:
    """Called when an actor's start ended, however it ended."""
    import ray

    try:
        ray.get(handle.end.remote(ray.get_runtime_context().get_actor_id()), timeout=REPORT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a later restart of this actor would count it as died starting
        log.warning("could not note an actor's start: %s: %s", type(e).__name__, e)


def _bare(exc: BaseException) -> BaseException:
    """`exc` without its traceback and chain (what it holds may not pickle), for the run's failure chain."""
    try:
        return type(exc)(*exc.args)
    except Exception:  # noqa: BLE001 - a constructor of other arguments: the type and message only
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def reporting(cls: type, handle) -> type:
    """`cls` (an actor pool's UDF class) whose constructor reports a failure to `handle` first, and whose
    restart after its process died while starting fails at once (module docstring)."""

    class Reporting(cls):
        def __init__(self, *args, **kwargs):
            died = begin_start(handle, cls.__name__)
            if died is not None:  # this actor's last start died with its process: no new try on that node
                raise ActorStartError(cls.__name__, died.line())
            try:
                super().__init__(*args, **kwargs)
            except Exception as e:
                report_start_failure(handle, cls.__name__, e)
                raise
            finally:
                end_start(handle)

    # Ray Data names the operator (and its actors' processes) after the class: MapBatches(ModelStage)
    Reporting.__name__, Reporting.__qualname__ = cls.__name__, cls.__qualname__
    return Reporting


RAY_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}  # map_batches' keyword -> Ray's resource


def fits(total: dict, need: dict) -> bool:
    """Whether a node with `total` resources (Ray's names) could hold one actor asking `need`
    (map_batches' num_cpus / num_gpus / memory)."""
    return all(total.get(RAY_NAMES[k], 0.0) >= v for k, v in need.items() if k in RAY_NAMES and v)


def check_left(stage: str, failures: list[StartFailure], need: dict, nodes: list[dict]) -> None:
    """`ActorStartError` when no actor of `stage` can start (module docstring): a fatal failure, or
    no live node in `nodes` (`ray.nodes()`) that fits `need` where `stage` has not failed."""
    fatal = next((f for f in failures if f.fatal), None)
    if fatal is not None:
        raise ActorStartError(stage, fatal.line(), fatal.trace, config=True) from fatal.error
    failed = {f.node_id for f in failures}
    if not any(n.get("Alive") and n["NodeID"] not in failed and fits(n.get("Resources", {}), need) for n in nodes):
        raise ActorStartError(stage, f"{stage} failed to start on every node that can hold it: "
                              + "; ".join(f.line() for f in failures),
                              "\n".join(f.trace for f in failures)) from failures[-1].error


def node_options(handle, stage: str, need: dict) -> Callable[[], dict]:
    """A pool's `ray_remote_args_fn` (Ray Data calls it in the driver before it starts each actor):
    a `label_selector` keeping the actor off the nodes where one of `stage` failed to start; raises
    `ActorStartError` when none is left (`check_left`)."""
    import ray

    def options() -> dict:
        failures = [f for f in ray.get(handle.get.remote(), timeout=60) if f.stage == stage]
        if not failures:
            return {}
        check_left(stage, failures, need, ray.nodes())
        return {"label_selector": {NODE_ID_LABEL: f"!in({','.join(sorted({f.node_id for f in failures}))})"}}

    return options


@dataclass(frozen=True)
class RunPlacement:
    """One run's placement on the driver: its `StartFailures` actor (`failures`) and each pool's actor
    resources by stage (`needs`: {"ModelStage": {"num_cpus": 0.25, "num_gpus": 1}}, filled by
    `map_stage` as the graph is built, watched by `node_loss.watching_nodes`)."""

    failures: object
    needs: dict = field(default_factory=dict)


def map_stage(ds, cls: type, placement: RunPlacement | None, **kw):
    """`ds.map_batches(cls, **kw)`; with the run's `placement`, the class reports a failed start, the
    pool keeps new actors off the nodes where one failed (`reporting`, `node_options`) and its
    resources are recorded for the node-loss watch (`node_loss.py`)."""
    if placement is None:
        return ds.map_batches(cls, **kw)
    import warnings

    placement.needs[cls.__name__] = {k: kw[k] for k in RAY_NAMES if kw.get(k)}
    failures = placement.failures
    with warnings.catch_warnings():  # Ray 2.60 (pinned) warns that ray_remote_args_fn goes in 2.64
        warnings.filterwarnings("ignore", message=".*ray_remote_args_fn.*")
        return ds.map_batches(reporting(cls, failures), ray_remote_args_fn=node_options(failures, cls.__name__, kw),
                              **kw)


def failed_lines(handle) -> list[str]:
    """Each failed start as one line (`StartFailure.line`), for the run's summary."""
    import ray

    return [f.line() for f in ray.get(handle.get.remote(), timeout=60)]
