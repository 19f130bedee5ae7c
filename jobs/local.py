"""Running a job in this process: `vlbatch run` (also the entrypoint of submitted jobs).

Order of work: validate the config and check its local paths (no Ray), take the job's
overlap lock, connect to Ray, run the pipeline (`vlbatch.pipeline.graph.run_job`), print
one line saying what the run produced, turn its summary into an exit code.

Which Ray (`vlbatch.jobs.connect`): ``--address`` or the config's ``ray.address`` when set;
else ``RAY_ADDRESS`` (set by Ray for submitted jobs, so they run on their cluster); else a
new local Ray started for this run and shut down with it (a Ray already running on this
machine is joined only with ``--address auto``). The first line printed is the run's plan
(`vlbatch.pipeline.plan.spec`: input count, pools and what they reserve), printed before Ray
starts, then ``[vlbatch] starting Ray``, unless the input's every request is committed already
(`pipeline/startup/nothing_to_do.py`: ``[vlbatch] nothing to do: all N requests of <run dir>/ are committed``,
exit 0, no Ray started, `_summary.json` kept); the next names the cluster, e.g.
``[vlbatch] ray: new local cluster (2 CPUs; metrics: http://10.0.0.5:51234/metrics)`` (its metrics endpoint)
or ``[vlbatch] ray: 10.0.0.5:6379``; a cluster
that cannot be reached or refuses us is exit 5 (`ClusterUnreachableError`), one line.
Ray's console noise stays in its log files unless ``verbose``.

Before any Ray process starts the same preflight as `vlbatch validate` runs, once, in the same
order (`pipeline/plan/preflight.py`: paths, input, checkpoint, output and fingerprint, and the pool
plan against the cluster the run uses; for a joined cluster that last step once connected, before
the graph starts); pools the config leaves at their defaults are sized down to fit (one line says
so). The checked `RunPlan` goes to `run_job`, which checks nothing again. A run that fails inside Ray prints one
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

from vlbatch.jobs.connect import RayTarget, connect_said, quiet_ray
from vlbatch.jobs.errors import EXIT_JOB_FAILED, EXIT_OK
from vlbatch.jobs.run_logs import driver_stderr_path, error_log_path, made, run_log_dir
from vlbatch.jobs.scheduling import run_lock, submission_id
from vlbatch.operators.errors import ActorStartError, VlbatchError


def summary_exit_code(summary: Any) -> int:
    """RunSummary -> exit code. The runner decides failure (past both ``max_error_fraction`` and
    ``min_error_rows``: 1, else 0); we pass its verdict on, never recompute it."""
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
    if errors := summary.errors_text():  # all rows written or not; which error limit was passed, if any
        line += f"; {errors}"
    if verdict := (getattr(summary, "occupancy", None) or {}).get("verdict"):  # the pool to grow
        line += f"; {verdict}"
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
    from vlbatch.jobs.stops import Interrupted, stop_signals
    from vlbatch.pipeline.config import load_config

    # SIGINT / SIGTERM from here to the last line end the run in one line, exit 130 / 143 (jobs/stops.py);
    # before the config is read the CLI says `vlbatch: interrupted` with the same code (jobs/cli.py)
    with stop_signals():
        config = load_config(config_path, list(overrides))
        job_name = name or Path(config_path).stem
        if slot is not None and not config.output.run_id:  # a scheduled run: one output per slot
            config = load_config(config_path, [*overrides, f"output.run_id={submission_id(job_name, slot)}"])
        try:
            if not use_lock:
                return _run(config, job_name, address, verbose, report)
            with run_lock(job_name, lock_dir):
                return _run(config, job_name, address, verbose, report)
        except Interrupted as stop:  # before Ray starts (the checks, the plan) or after its shutdown
            return stopped(config, stop, writers_gone=False)


def stopped(config: Any, stop: Any, *, writers_gone: bool) -> int:
    """The interrupted run's one line (`jobs/stops.finish_interrupted`; a second signal meanwhile is
    ignored) -> its exit code (130 / 143). `writers_gone`: a new local Ray ran and is shut down."""
    from vlbatch.jobs.stops import finish_interrupted, signals_ignored

    with signals_ignored():
        print(finish_interrupted(config, writers_gone=writers_gone), flush=True)
    return stop.exit_code


def plan_notes(plan: Any) -> None:
    """The lines on what the preflight changed for this cluster: default CPU shares sized down, the
    model planned on the CPU though it asked GPUs (none here)."""
    if line := sized_line(plan):
        print(line, flush=True)
    if device := plan.device_line():
        print(f"[vlbatch] {device}", flush=True)


def sized_line(plan: Any) -> str | None:
    """The line saying which default CPU shares the preflight sized down to the cluster (None: none)."""
    if not plan.sized:
        return None
    what = ", ".join(f"{k} {v:g}" for k, v in plan.sized.items())
    return (f"[vlbatch] resources: default CPU shares sized to {plan.cluster.where} ({plan.cluster.cpus:g} CPUs): "
            f"{what}")


def run_plan(config: Any, *, new_local: bool) -> Any:
    """The run's checked `RunPlan`, before Ray starts (`pipeline/plan/preflight.py`, every step once): on a
    new local Ray (`new_local`) against this machine, so the plan line prints what `vlbatch validate`
    prints; a joined cluster's `fit` step runs once connected (`joined_plan`)."""
    from vlbatch.pipeline.plan.cluster import local_cluster
    from vlbatch.pipeline.plan.preflight import preflight

    plan = preflight(config, local_cluster() if new_local else None)
    plan_notes(plan)
    return plan


def joined_plan(plan: Any, where: str) -> Any:
    """A joined cluster, once connected: the preflight's `fit` step on it; when that changes the plan line
    (default pools sized down, the model's GPUs resolved there) a new one is printed, on that cluster."""
    from vlbatch.pipeline.plan.cluster import joined_cluster
    from vlbatch.pipeline.plan.preflight import fit_plan

    fitted = fit_plan(plan, joined_cluster(where))
    plan_notes(fitted)
    if fitted.line() != plan.line():
        print(fitted.line(), flush=True)
    return fitted


def _shutdown_ray() -> list[int]:
    """`ray.shutdown()` run to its end whatever signal comes (jobs/stops.signals_deferred) -> the signals
    that came meanwhile."""
    import ray

    from vlbatch.jobs.stops import signals_deferred

    with signals_deferred() as noted:
        # a stopped stream's iterator can sit in a reference cycle; Ray Data's __del__ shuts its
        # executor down and needs Ray: collect it now, not after ray.shutdown (a traceback then)
        gc.collect()
        ray.shutdown()
    return noted


def _run(config: Any, job_name: str, address: str | None, verbose: bool, report=None) -> int:
    import ray

    from vlbatch.jobs.failures import describe
    from vlbatch.jobs.reaper import reaped_ray
    from vlbatch.jobs.stops import Interrupted, interruption
    from vlbatch.pipeline.graph import run_job
    from vlbatch.pipeline.startup.nothing_to_do import open_run

    target = RayTarget.choose(address or config.ray.address)
    ours = not ray.is_initialized()  # an in-process caller's Ray is used as it is
    new_local = ours and target.address is None
    plan = run_plan(config, new_local=new_local)
    config, run_id = plan.cfg, plan.run.run_id
    print(plan.line(), flush=True)
    opened = open_run(plan)  # the sink and its committed index, read once (handed to run_job)
    if (idle := opened.idle) is not None:  # every request committed: no Ray started
        print(idle.line(), flush=True)
        return idle.exit_code
    logs = run_log_dir(run_id)  # this run's own log folder (jobs/run_logs.py), made for `quiet_ray` to fill
    noise = driver_stderr_path(logs if verbose else made(logs))
    noted: list[int] = []  # signals that came during Ray's shutdown (signals_deferred)
    try:  # a new local Ray's processes end with this one, however it ends (jobs/reaper.py)
        with reaped_ray() if new_local else nullcontext(), quiet_ray(noise, verbose):
            try:
                if ours:
                    where = connect_said(target, verbose=verbose)  # our signal handlers set again after ray.init
                    if target.address is not None:
                        plan = joined_plan(plan, where)
                else:
                    plan = joined_plan(plan, "the running Ray")
                config = plan.cfg
                print(f"[vlbatch] job {job_name!r} run_id={run_id} output={config.output.uri}", flush=True)
                summary = run_job(plan, name=job_name, opened=opened)
            finally:
                if ours:
                    noted = _shutdown_ray()
        if noted:  # the run finished and a signal came while Ray shut down: it ends the run as at any moment
            raise Interrupted(noted[0])
    except Interrupted as stop:
        return stopped(config, stop, writers_gone=new_local)
    except Exception as e:  # noqa: BLE001 - a failure inside Ray: one line, the detail in the log
        # raised while a signal unwound the run: a stop; never our own typed error (the node-loss watch stops a
        # run through SIGINT and raises NodesLostError from it: exit 8, not 130)
        if not isinstance(e, VlbatchError) and (stop := interruption(e)) is not None:
            return stopped(config, stop, writers_gone=new_local)
        if isinstance(e, VlbatchError) and type(e).__module__.startswith("vlbatch.") \
                and not isinstance(e, ActorStartError):  # a stage's actors could not start: described below
            raise  # ours, raised here (ConfigError, ClusterUnreachableError): one line in jobs/commands.py
        # (Ray's RayTaskError of a UDF's ConfigError is an instance of it too, with Ray's traceback as text)
        failure = describe(e, config, error_log_path(logs))
        print(failure.line, file=sys.stderr, flush=True)
        return failure.exit_code
    if report is None:
        print(summary_line(summary), flush=True)
    else:
        report(summary)
    return summary_exit_code(summary)
