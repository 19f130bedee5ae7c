"""Running a job in this process: `vlbatch run` (also the entrypoint of submitted jobs).

Order of work: validate the config and check its local paths (no Ray), take the job's
overlap lock, connect to Ray, run the pipeline (`vlbatch.pipeline.graph.run_job`), print
one line saying what the run produced, turn its summary into an exit code.

Which Ray (`vlbatch.jobs.connect`): ``--address`` or the config's ``ray.address`` when set;
else ``RAY_ADDRESS`` (set by Ray for submitted jobs, so they run on their cluster); else a
new local Ray started for this run and shut down with it (a Ray already running on this
machine is joined only with ``--address auto``). The first line printed is the run's plan
(`vlbatch.pipeline.plan.spec`: input count, pools and what they reserve), printed before Ray
starts, then ``[vlbatch] starting Ray``; the next names the cluster, e.g.
``[vlbatch] ray: new local cluster (2 CPUs)`` or ``[vlbatch] ray: 10.0.0.5:6379``; a cluster
that cannot be reached or refuses us is exit 5 (`ClusterUnreachableError`), one line.
Ray's console noise stays in its log files unless ``verbose``.

Before any Ray process starts (and, for a joined cluster, before the graph starts) the same
checks as `vlbatch validate` run (`pipeline/plan/checkpoint.py`, `pipeline/plan/cluster.py`): the
checkpoint, and the pool plan against the cluster the run uses; pools the config leaves at
their defaults are sized down to fit (one line says so). A run that fails inside Ray prints one
line (`jobs/failures.py`: the cause, the field, exit 2 / 8 / 1) with the detail in a log file;
SIGINT / SIGTERM end it with one line and exit 130 / 143 (`jobs/stops.py`). The processes of a new
local Ray end with the run however it ends, SIGKILL included (`jobs/reaper.py`).
"""
from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from vlbatch.jobs.connect import RayTarget, connect, driver_stderr_path, quiet_ray
from vlbatch.jobs.errors import EXIT_JOB_FAILED, EXIT_OK
from vlbatch.jobs.scheduling import run_lock, submission_id
from vlbatch.operators.errors import ActorStartError, VlbatchError


def summary_exit_code(summary: Any) -> int:
    """RunSummary -> exit code. The runner decides failure (error share over
    ``max_error_fraction``: 1, else 0); we pass its verdict on, never recompute it."""
    return EXIT_JOB_FAILED if summary.exit_code else EXIT_OK


def summary_line(summary: Any) -> str:
    """The run's last line: rows ok / error / skipped (committed before), duplicate requests dropped
    (every manifest row accounted for), where, how long."""
    done = dict(summary.processed_by_status)
    ok, err = done.pop("ok", 0), done.pop("error", 0)
    other = "".join(f", {n} {k}" for k, n in sorted(done.items()))
    dropped = getattr(summary, "duplicates_dropped", None) or 0
    dup = f", {dropped} duplicate requests dropped (identical to an earlier manifest row)" if dropped else ""
    line = (f"[vlbatch] done: {ok} ok, {err} error{other}, {summary.requests_skipped} skipped "
            f"(already committed){dup} -> {summary.output_dir.rstrip('/')}/ in {summary.elapsed_s:.1f}s")
    if summary.exceeded_error_fraction:
        line += (f"; error share {summary.error_fraction:.0%} > max_error_fraction "
                 f"{summary.max_error_fraction:.0%}: failed")
    return line


def run_local(
    config_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    name: str | None = None,
    address: str | None = None,
    slot: str | None = None,
    lock_dir: Path | None = None,
    use_lock: bool = True,
    verbose: bool = False,
    report: Callable[[Any], None] | None = None,
) -> int:
    """Run one job to completion here; raises ConfigError / OverlapError before any work,
    ClusterUnreachableError before the pipeline starts.

    With a `slot` (cron / RayCronJob runs) the run id is ``vlb-<name>-<slot>`` unless the
    config pins one, so every retry of the same tick resumes the same output. `report` receives the
    `RunSummary` (default: print its `summary_line`; the demo prints it after its listing).
    """
    from vlbatch.pipeline.plan.checks import check_paths
    from vlbatch.pipeline.config import load_config

    config = load_config(config_path, list(overrides))
    job_name = name or Path(config_path).stem
    if slot is not None and not config.output.run_id:  # a scheduled run: one output per slot
        config = load_config(config_path, [*overrides, f"output.run_id={submission_id(job_name, slot)}"])
    check_paths(config)
    from vlbatch.pipeline.stages.write_stage import check_output

    check_output(config)  # the output bucket exists (never created): before Ray starts
    from vlbatch.pipeline.plan.fingerprint import check_fingerprint

    check_fingerprint(config)  # a pinned run_id holding answers of another config: refused before Ray starts
    from vlbatch.pipeline.plan.checkpoint import check_checkpoint

    check_checkpoint(config)  # what a model or CPU actor would die on
    if not use_lock:
        return _run(config, job_name, address, verbose, report)
    with run_lock(job_name, lock_dir):
        return _run(config, job_name, address, verbose, report)


def error_log_path(job_name: str) -> Path:
    """Where a failed run's full error (Ray's tracebacks) is written: beside the driver's stderr log."""
    p = driver_stderr_path(job_name)
    return p.with_name(p.name.replace(".driver-stderr.log", ".error.log"))


def checked(config: Any, cluster: Any) -> Any:
    """`check_plan` against `cluster`, one line when default pools were sized down; -> the config to run."""
    from vlbatch.pipeline.plan.checkpoint import check_plan

    config, sized = check_plan(config, cluster)
    if sized:
        what = ", ".join(f"{k} {v:g}" for k, v in sized.items())
        print(f"[vlbatch] resources: default CPU shares sized to {cluster.where} ({cluster.cpus:g} CPUs): {what}",
              flush=True)
    return config


def run_plan(config: Any, *, new_local: bool) -> tuple[Any, Any]:
    """(the config to run, its `RunPlan`), before Ray starts: on a new local Ray (`new_local`) the plan
    is checked against this machine first and its GPUs resolved there, so the plan line prints what
    `vlbatch validate` prints; a joined cluster's plan is checked once connected."""
    from vlbatch.pipeline.plan.cluster import local_cluster
    from vlbatch.pipeline.plan.spec import plan_run

    cluster = local_cluster() if new_local else None
    if cluster is not None:
        config = checked(config, cluster)
    return config, plan_run(config, cluster)  # the input count and the pools


def joined_plan(config: Any, plan: Any, where: str) -> tuple[Any, Any]:
    """A joined cluster, once connected: the plan checked against it; when that changes the plan line
    (default pools sized down, the model's GPUs resolved there) a new one is printed, on that cluster."""
    from vlbatch.pipeline.plan.cluster import joined_cluster
    from vlbatch.pipeline.plan.spec import plan_run, pools_text

    cluster = joined_cluster(where)
    config = checked(config, cluster)
    if config != plan.cfg or pools_text(config, cluster) != pools_text(plan.cfg, plan.cluster):
        plan = plan_run(config, cluster)
        print(plan.line(), flush=True)
    return config, plan


def _run(config: Any, job_name: str, address: str | None, verbose: bool, report=None) -> int:
    import ray

    from vlbatch.jobs.failures import describe
    from vlbatch.jobs.reaper import reaped_ray
    from vlbatch.jobs.stops import Interrupted, arm, finish_interrupted, signals_ignored, stop_signals
    from vlbatch.pipeline.graph import run_job

    target = RayTarget.choose(address or config.ray.address)
    ours = not ray.is_initialized()  # an in-process caller's Ray is used as it is
    new_local = ours and target.address is None
    config, plan = run_plan(config, new_local=new_local)
    print(plan.line(), flush=True)
    try:  # a new local Ray's processes end with this one, however it ends (jobs/reaper.py)
        with quiet_ray(job_name, verbose), stop_signals(), reaped_ray() if new_local else nullcontext():
            try:
                if ours:
                    print("[vlbatch] starting Ray", flush=True)
                    where = connect(target, verbose=verbose)
                    arm()  # ray.init replaced our SIGTERM handler with its own
                    print(f"[vlbatch] ray: {where}", flush=True)
                    if target.address is not None:
                        config, plan = joined_plan(config, plan, where)
                else:
                    config, plan = joined_plan(config, plan, "the running Ray")
                print(f"[vlbatch] job {job_name!r} run_id={config.resolved_run_id()} output={config.output.uri}",
                      flush=True)
                summary = run_job(config, plan=plan)
            finally:
                if ours:
                    with signals_ignored():
                        # a stopped stream's iterator can sit in a reference cycle; Ray Data's __del__ shuts its
                        # executor down and needs Ray: collect it now, not after ray.shutdown (a traceback then)
                        gc.collect()
                        ray.shutdown()
    except Interrupted as stop:
        with signals_ignored():
            print(finish_interrupted(config, writers_gone=new_local), flush=True)
        return stop.exit_code
    except Exception as e:  # noqa: BLE001 - a failure inside Ray: one line, the detail in the log
        if isinstance(e, VlbatchError) and type(e).__module__.startswith("vlbatch.") \
                and not isinstance(e, ActorStartError):  # a stage's actors could not start: described below
            raise  # ours, raised here (ConfigError, ClusterUnreachableError): one line in jobs/commands.py
        # (Ray's RayTaskError of a UDF's ConfigError is an instance of it too, with Ray's traceback as text)
        failure = describe(e, config, error_log_path(job_name))
        print(failure.line, file=sys.stderr, flush=True)
        return failure.exit_code
    if report is None:
        print(summary_line(summary), flush=True)
    else:
        report(summary)
    return summary_exit_code(summary)
