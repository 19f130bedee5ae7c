"""Actors that cannot start on a node (issue 48, pipeline/startup/placement.py): the rule that decides
whether a pool can still start an actor somewhere, and the real Ray Data path when it cannot (a
bounded failure in one line, never a wait). The multi-node runs are tests/test_multinode_faults.py."""
from __future__ import annotations

import contextlib

import pytest

from vlbatch.operators.errors import ActorStartError, ConfigError
from vlbatch.pipeline.startup.placement import StartFailure, check_left

NEED = {"num_cpus": 0.25, "num_gpus": 1, "compute": object()}


def _node(node_id: str, gpus: float, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, "GPU": gpus}}


def _failed(node_id: str, error: BaseException | None = None) -> StartFailure:
    error = error or NotADirectoryError("[Errno 20] Not a directory: '/x/not-a-folder/cache'")
    return StartFailure("ModelStage", node_id, "10.0.0.9", f"{type(error).__name__}: {error}",
                        isinstance(error, ConfigError), error=error)


@contextlib.contextmanager
def init_deaths(n: int):
    """Ray Data's `max_consecutive_actor_init_deaths` at `n` (as the run sets it) for the block, restored after:
    the real runs below use the session's Ray and this process's DataContext, shared with later tests."""
    import ray

    ctx = ray.data.DataContext.get_current()
    saved = ctx.max_consecutive_actor_init_deaths
    ctx.max_consecutive_actor_init_deaths = n
    try:
        yield
    finally:
        ctx.max_consecutive_actor_init_deaths = saved


def test_a_node_left_that_fits_lets_the_pool_go_on():
    nodes = [_node("head", 0), _node("bad", 1), _node("good", 1)]
    check_left("ModelStage", [_failed("bad")], NEED, nodes)  # no error: "good" can hold a replica


def test_no_node_left_that_fits_stops_the_run_naming_each_failure():
    nodes = [_node("head", 0), _node("bad", 1), _node("good", 1, alive=False)]
    with pytest.raises(ActorStartError, match=r"every node that can hold it: ModelStage on node 10.0.0.9 \(bad\)"
                                              r": NotADirectoryError") as info:
        check_left("ModelStage", [_failed("bad")], NEED, nodes)
    assert info.value.stage == "ModelStage"
    with pytest.raises(ActorStartError):  # two failed GPU nodes, the head has no GPU
        check_left("ModelStage", [_failed("bad"), _failed("good")], NEED, [_node("head", 0), _node("bad", 1),
                                                                            _node("good", 1)])


def test_the_jobs_own_error_stops_the_run_at_its_first_failure():
    broken = ConfigError("model.path: the checkpoint is broken")
    nodes = [_node("bad", 1), _node("good", 1)]
    with pytest.raises(ActorStartError) as info:
        check_left("ModelStage", [_failed("bad", broken)], NEED, nodes)
    assert info.value.__cause__ is broken


@pytest.mark.ray
def test_no_node_for_a_failing_actor_pool_ends_a_real_ray_data_run_in_one_line(tmp_path):
    """Every actor of a pool fails to start on the only node: the run raises `ActorStartError`
    (after one death, the replacement would have nowhere to go) and `describe` makes it one line,
    exit 8, naming the stage and the cause; the actor's traceback goes to the log file."""
    import ray

    from vlbatch.jobs.failures import describe
    from vlbatch.pipeline.startup.placement import (
        INIT_DEATHS,
        failed_lines,
        node_options,
        reporting,
        start_failures,
    )

    class ModelStage:  # named as the product's stage: describe names the model stage
        def __init__(self):
            raise NotADirectoryError("[Errno 20] Not a directory: '/x/not-a-folder/cache'")

        def __call__(self, batch):
            return batch

    with init_deaths(INIT_DEATHS):
        failures = start_failures()
        kw = {"num_cpus": 0.25, "compute": ray.data.ActorPoolStrategy(min_size=1, max_size=1)}
        ds = ray.data.range(4).map_batches(reporting(ModelStage, failures),
                                           ray_remote_args_fn=node_options(failures, "ModelStage", kw), **kw)
        with pytest.raises(ActorStartError) as info:
            ds.materialize()
        lines = failed_lines(failures)
    assert len(lines) == 1 and lines[0].startswith("ModelStage on node ") and "not-a-folder" in lines[0], lines
    failure = describe(info.value, None, tmp_path / "err.log")
    assert failure.exit_code == 8
    assert failure.line.startswith("vlbatch: the model stage could not start: ActorStartError: ModelStage failed "
                                   "to start on every node that can hold it: ModelStage on node "), failure.line
    assert "NotADirectoryError" in failure.line and "\n" not in failure.line
    assert "in __init__" in (tmp_path / "err.log").read_text()  # the actor's own traceback, in the file


@pytest.mark.ray
@pytest.mark.timeout(300)  # a hang guard: before, Ray restarted the actor in place for ever ("0/1 model actors ready")
def test_an_actor_killed_while_starting_ends_the_run_in_one_line(tmp_path):
    """Issue 60 item 16: the actor's process dies in its constructor (a real SIGKILL); Ray restarts it in place,
    the restart finds its start unfinished and fails at once, so the node counts as failed and with no node
    left the run stops: `ActorStartError`, one line, exit 8, naming the node and that the process died."""
    import os
    import signal

    import ray

    from vlbatch.jobs.failures import describe
    from vlbatch.pipeline.startup.placement import (
        INIT_DEATHS,
        failed_lines,
        node_options,
        reporting,
        start_failures,
    )

    class ModelStage:  # named as the product's stage; SIGKILLed while it starts, as by the OOM killer
        def __init__(self):
            os.kill(os.getpid(), signal.SIGKILL)

        def __call__(self, batch):
            return batch

    with init_deaths(INIT_DEATHS):
        failures = start_failures()
        kw = {"num_cpus": 0.25, "compute": ray.data.ActorPoolStrategy(min_size=1, max_size=1)}
        ds = ray.data.range(4).map_batches(reporting(ModelStage, failures),
                                           ray_remote_args_fn=node_options(failures, "ModelStage", kw), **kw)
        with pytest.raises(ActorStartError) as info:
            ds.materialize()
        lines = failed_lines(failures)
    assert len(lines) == 1 and lines[0].startswith("ModelStage on node ") and "process died" in lines[0], lines
    failure = describe(info.value, None, tmp_path / "err.log")
    assert failure.exit_code == 8 and "\n" not in failure.line
    assert failure.line.startswith("vlbatch: the model stage could not start: ActorStartError: ModelStage failed "
                                   "to start on every node that can hold it: ModelStage on node "), failure.line
    assert "its process died while the actor started (killed by the OOM killer" in failure.line, failure.line


# Nodes lost mid-run (pipeline/startup/node_loss.py: watch_nodes, watching_nodes). The real cluster run is
# tests/test_multinode_faults.py::test_every_model_node_lost_mid_run_ends_the_run_in_one_line.

def _ray_node(node_id: str, gpus: float, alive: bool = True) -> dict:
    return {**_node(node_id, gpus, alive), "NodeManagerAddress": f"10.0.0.{len(node_id)}"}


def test_node_watch_arms_on_a_node_that_fits_and_stops_after_the_grace():
    from vlbatch.operators.errors import NodesLostError
    from vlbatch.pipeline.startup.node_loss import NodeWatch, watch_nodes

    need = {"num_cpus": 0.25, "num_gpus": 1}
    up = [_ray_node("head", 0), _ray_node("worker-a", 1), _ray_node("worker-b", 1)]
    down = [_ray_node("head", 0), _ray_node("worker-a", 1, alive=False), _ray_node("worker-b", 1, alive=False)]
    # a cluster that never had a node that fits (an autoscaler may add one): not watched, never stopped
    assert watch_nodes("ModelStage", need, down, NodeWatch(), 0.0, 5.0) == NodeWatch()
    assert watch_nodes("ModelStage", need, down, NodeWatch(), 1e9, 5.0) == NodeWatch()
    w = watch_nodes("ModelStage", need, up, NodeWatch(), 0.0, 5.0)
    assert w.held == ("10.0.0.8 (worker-a)", "10.0.0.8 (worker-b)") and w.lost_since is None
    lost = watch_nodes("ModelStage", need, down, w, 10.0, 5.0)  # the first check that finds none: the grace starts
    assert lost == NodeWatch(w.held, 10.0)
    assert watch_nodes("ModelStage", need, down, lost, 14.9, 5.0) == lost  # within the grace
    back = watch_nodes("ModelStage", need, [*down, _ray_node("worker-c", 1)], lost, 14.9, 5.0)
    assert back.lost_since is None and back.held == ("10.0.0.8 (worker-c)",)  # a node came back (or was added)
    with pytest.raises(NodesLostError, match=r"ModelStage lost every node that can hold its actor \(1 GPU, 0.25 CPU\):"
                                             r" 10.0.0.8 \(worker-a\), 10.0.0.8 \(worker-b\) gone and none came back "
                                             r"within ray.node_loss_timeout_s=5s") as info:
        watch_nodes("ModelStage", need, down, lost, 15.0, 5.0)
    assert info.value.stage == "ModelStage" and isinstance(info.value, ActorStartError)
    # a node that is alive but too small (no GPU, or less memory) does not hold the actor
    big = {"num_cpus": 1, "memory": 8 << 30}
    small = [{**_ray_node("worker-a", 1), "Resources": {"CPU": 4.0, "memory": float(4 << 30)}}]
    armed = watch_nodes("ModelStage", big, [{**small[0], "Resources": {"CPU": 4.0, "memory": float(8 << 30)}}],
                        NodeWatch(), 0.0, 1.0)
    with pytest.raises(NodesLostError, match=r"\(1 CPU, 8 GiB memory\)"):
        watch_nodes("ModelStage", big, small, watch_nodes("ModelStage", big, small, armed, 0.0, 1.0), 1.0, 1.0)


def test_node_timeout_must_be_positive():
    from vlbatch.pipeline.config import validate_config

    base = {"model": {"path": "/m"}, "input": {"uri": "/m.parquet"}, "output": {"uri": "/out"}}
    assert validate_config(base).ray.node_loss_timeout_s == 300.0
    with pytest.raises(ConfigError, match="ray.node_loss_timeout_s"):
        validate_config({**base, "ray": {"node_loss_timeout_s": 0}})


@pytest.mark.ray
def test_every_node_of_a_pool_lost_ends_a_real_ray_data_run_in_one_line(tmp_path):
    """The watch in a real Ray Data run: once the pool's nodes are gone past the grace, iterating the
    dataset raises `NodesLostError` and `describe` makes it one line, exit 8, naming the stage and the
    node loss. Mocked: only the node list (a one-node local Ray cannot lose a node; the real loss is the
    multi-node test); the actors block, so the stream is still running whenever the watch decides."""
    import threading

    import ray

    from vlbatch.jobs.failures import describe
    from vlbatch.operators.errors import NodesLostError
    from vlbatch.pipeline.config.schema import RaySection
    from vlbatch.pipeline.startup.node_loss import watching_nodes
    from vlbatch.pipeline.startup.placement import RunPlacement, map_stage, start_failures

    class ModelStage:
        def __call__(self, batch):
            threading.Event().wait(600)  # a model call that never ends here (the run is stopped first)
            return batch

    listed = []

    def nodes() -> list[dict]:  # a GPU node on the first listing, gone on every later one
        listed.append(1)
        return [_ray_node("head", 0), _ray_node("worker-a", 1, alive=len(listed) == 1)]

    placement = RunPlacement(start_failures())
    kw = {"num_cpus": 0.25, "compute": ray.data.ActorPoolStrategy(min_size=1, max_size=1)}
    ds = map_stage(ray.data.range(4), ModelStage, placement, **kw)
    placement.needs["ModelStage"] = {"num_cpus": 0.25, "num_gpus": 1}  # as a GPU pool asks (none here)
    grace = RaySection(node_loss_timeout_s=0.5, progress_interval_s=0.1)
    batches = iter(ds.iter_batches(batch_size=None))  # a generator: closed below
    try:
        with pytest.raises(NodesLostError) as info, watching_nodes(placement, grace, nodes=nodes):
            for _ in batches:
                pass
    finally:
        batches.close()  # the session's Ray goes on: the stream ends here, its blocked actor with it
    failure = describe(info.value, None, tmp_path / "err.log")
    assert failure.exit_code == 8
    assert failure.line.startswith("vlbatch: the model stage lost its nodes: NodesLostError: ModelStage lost every "
                                   "node that can hold its actor (1 GPU, 0.25 CPU): 10.0.0.8 (worker-a) gone"), failure.line
    assert "\n" not in failure.line


def test_the_watch_ends_a_run_that_started_with_sigint_ignored():
    """A run started as a background job of a non-interactive shell (`vlbatch run ... &` in a script, cron)
    inherits SIGINT ignored: the watch's own SIGINT still ends the loop (it was lost, and the run hung), anyone
    else's stays ignored, and the ignore is back afterwards. Mocked: only the node list, as above."""
    import signal
    import threading
    import types

    from vlbatch.operators.errors import NodesLostError
    from vlbatch.pipeline.config.schema import RaySection
    from vlbatch.pipeline.startup.node_loss import watching_nodes

    listed = []

    def nodes() -> list[dict]:  # a GPU node on the first listing, gone on every later one
        listed.append(1)
        return [_ray_node("head", 0), _ray_node("worker-a", 1, alive=len(listed) == 1)]

    placement = types.SimpleNamespace(needs={"ModelStage": {"num_cpus": 0.25, "num_gpus": 1}})
    grace = RaySection(node_loss_timeout_s=0.5, progress_interval_s=0.1)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(NodesLostError, match="worker-a"), watching_nodes(placement, grace, nodes=nodes):
            signal.raise_signal(signal.SIGINT)  # someone else's Ctrl-C: still ignored
            threading.Event().wait(300)  # the run's loop; only the watch's SIGINT ends it (main: it waited it out)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_node_lost_mid_run_that_the_run_survives_is_said_in_one_line():
    """Issue 60 item 16: a run that lost a node and went on (Ray retried its work elsewhere) said nothing.
    The nodes seen alive and lost since; the watch lists them when it starts and once more when the block
    ends, so a loss between two checks counts too. Mocked: only the node list (the real loss:
    tests/test_multinode_faults.py::test_worker_node_killed_mid_run_job_finishes_on_the_other)."""
    import types

    from vlbatch.pipeline.config.schema import RaySection
    from vlbatch.pipeline.startup.node_loss import NodesSeen, watching_nodes

    up = [_ray_node("head", 0), _ray_node("worker-a", 1), _ray_node("worker-b", 1)]
    a_gone = [_ray_node("head", 0), _ray_node("worker-a", 1, alive=False), _ray_node("worker-b", 1)]
    said = ("[vlbatch] node 10.0.0.8 (worker-a) was lost mid-run; Ray retried its work on the nodes left and the run "
            "went on")
    seen = NodesSeen().after(up)
    assert seen.line() is None
    assert seen.after(a_gone).line() == said and seen.after(a_gone).after(a_gone).line() == said  # once
    both = seen.after(a_gone).after([_ray_node("head", 0)])  # gone from the listing: lost too
    assert both.lost == ("10.0.0.8 (worker-a)", "10.0.0.8 (worker-b)") and "nodes 10.0.0.8 (worker-a), " in both.line()
    assert NodesSeen().after(a_gone).line() is None  # never seen alive: not this run's loss

    listings = iter([up])

    def nodes() -> list[dict]:  # alive at the start, worker-a gone at every later listing
        return next(listings, a_gone)

    placement = types.SimpleNamespace(needs={"ModelStage": {"num_cpus": 0.25, "num_gpus": 1}})
    no_check_between = RaySection(node_loss_timeout_s=600, progress_interval_s=600)
    with watching_nodes(placement, no_check_between, nodes=nodes) as watch:
        pass
    assert watch.seen.line() == said
