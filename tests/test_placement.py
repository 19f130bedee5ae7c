"""Actors that cannot start on a node (issue 48, pipeline/placement.py): the rule that decides
whether a pool can still start an actor somewhere, and the real Ray Data path when it cannot (a
bounded failure in one line, never a wait). The multi-node runs are tests/test_multinode_faults.py."""
from __future__ import annotations

import pytest

from vlbatch.operators.errors import ActorStartError, ConfigError
from vlbatch.pipeline.placement import StartFailure, check_left

NEED = {"num_cpus": 0.25, "num_gpus": 1, "compute": object()}


def _node(node_id: str, gpus: float, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, "GPU": gpus}}


def _failed(node_id: str, error: BaseException | None = None) -> StartFailure:
    error = error or NotADirectoryError("[Errno 20] Not a directory: '/x/not-a-folder/cache'")
    return StartFailure("ModelStage", node_id, "10.0.0.9", f"{type(error).__name__}: {error}",
                        isinstance(error, ConfigError), error=error)


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


def test_no_node_for_a_failing_actor_pool_ends_a_real_ray_data_run_in_one_line(tmp_path):
    """Every actor of a pool fails to start on the only node: the run raises `ActorStartError`
    (after one death, the replacement would have nowhere to go) and `describe` makes it one line,
    exit 8, naming the stage and the cause; the actor's traceback goes to the log file."""
    import ray

    from vlbatch.jobs.failures import describe
    from vlbatch.pipeline.placement import INIT_DEATHS, failed_lines, node_options, reporting, start_failures

    class ModelStage:  # named as the product's stage: describe names the model stage
        def __init__(self):
            raise NotADirectoryError("[Errno 20] Not a directory: '/x/not-a-folder/cache'")

        def __call__(self, batch):
            return batch

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.max_consecutive_actor_init_deaths = INIT_DEATHS
        failures = start_failures()
        kw = {"num_cpus": 0.25, "compute": ray.data.ActorPoolStrategy(min_size=1, max_size=1)}
        ds = ray.data.range(4).map_batches(reporting(ModelStage, failures),
                                           ray_remote_args_fn=node_options(failures, "ModelStage", kw), **kw)
        with pytest.raises(ActorStartError) as info:
            ds.materialize()
        lines = failed_lines(failures)
    finally:
        ray.shutdown()
    assert len(lines) == 1 and lines[0].startswith("ModelStage on node ") and "not-a-folder" in lines[0], lines
    failure = describe(info.value, None, tmp_path / "err.log")
    assert failure.exit_code == 8
    assert failure.line.startswith("vlbatch: the model stage could not start: ActorStartError: ModelStage failed "
                                   "to start on every node that can hold it: ModelStage on node "), failure.line
    assert "NotADirectoryError" in failure.line and "\n" not in failure.line
    assert "in __init__" in (tmp_path / "err.log").read_text()  # the actor's own traceback, in the file
