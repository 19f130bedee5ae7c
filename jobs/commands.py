"""The job subcommands of `vlbatch`: run, validate, submit, status, logs, stop, list, resume.

Thin argparse handlers: each parses flags, calls `vlbatch.jobs.local` / `vlbatch.jobs.spec` /
`vlbatch.jobs.submission`, prints, and returns an exit code (`vlbatch.jobs.errors.EXIT_*`). Typed errors
become one line on stderr and their exit code; nothing here holds state.

Cluster address (submit/status/logs/stop/list/resume): ``--address``, else
``$VLBATCH_ADDRESS``, else ``$RAY_API_SERVER_ADDRESS``, else http://127.0.0.1:8265.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from vlbatch.jobs.errors import EXIT_JOB_FAILED, EXIT_OK, EXIT_STOPPED, EXIT_USAGE, JobsError, SubmissionError
from vlbatch.operators.errors import ConfigError, VlbatchError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
_STATUS_EXIT = {"SUCCEEDED": EXIT_OK, "FAILED": EXIT_JOB_FAILED, "STOPPED": EXIT_STOPPED}


def _address(args: argparse.Namespace) -> str:
    return (
        args.address
        or os.environ.get("VLBATCH_ADDRESS")
        or os.environ.get("RAY_API_SERVER_ADDRESS")
        or DEFAULT_ADDRESS
    )


def _submitter(args: argparse.Namespace):
    from vlbatch.jobs.submission import Submitter

    return Submitter(_address(args))


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Typed errors -> one stderr line and their exit code (config errors: 2)."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ConfigError as e:
            print(f"vlbatch: {e}", file=sys.stderr)
            return EXIT_USAGE
        except JobsError as e:
            print(f"vlbatch: {e}", file=sys.stderr)
            return e.exit_code
        except VlbatchError as e:
            print(f"vlbatch: {e.error_type}: {e}", file=sys.stderr)
            return EXIT_JOB_FAILED

    return wrapped


def _write(chunk: str) -> None:
    sys.stdout.write(chunk)
    sys.stdout.flush()


def _print_state(state, as_json: bool) -> None:
    if as_json:
        print(json.dumps(state.to_json(), indent=2))
        return
    when = "-"
    if state.start_time:
        when = dt.datetime.fromtimestamp(state.start_time, dt.UTC).isoformat(timespec="seconds")
    print(f"{state.submission_id}  {state.status}  job={state.job_name} slot={state.slot} run_id={state.run_id}")
    print(f"  attempt {state.attempt}, started {when}; {state.message or ''}".rstrip())


def _finish(sub, sid: str, follow: bool, wait: bool) -> int:
    if follow:
        state = sub.follow(sid, _write)
    elif wait:
        state = sub.wait(sid)
    else:
        return EXIT_OK
    print(f"[vlbatch] {state.submission_id} {state.status}: {state.message or ''}", file=sys.stderr)
    return _STATUS_EXIT.get(state.status, EXIT_JOB_FAILED)


# ---- handlers -----------------------------------------------------------------
@_guard
def cmd_run(args: argparse.Namespace) -> int:
    from vlbatch.jobs.local import run_local

    return run_local(
        args.config, _overrides(args), name=args.name, address=args.address, slot=_slot(args),
        lock_dir=Path(args.lock_dir) if args.lock_dir else None, use_lock=not args.no_lock, verbose=args.verbose,
    )


@_guard
def cmd_validate(args: argparse.Namespace) -> int:
    """The preflight `vlbatch run` runs (`pipeline/plan/preflight.py`, the same steps in the same order,
    the output's bucket and fingerprint included) against the cluster `run` would use; prints its pools."""
    from vlbatch.jobs.connect import RayTarget
    from vlbatch.pipeline.config import load_config
    from vlbatch.pipeline.config.choices import chosen_text
    from vlbatch.pipeline.plan.cluster import local_cluster
    from vlbatch.pipeline.plan.preflight import fit_plan, preflight

    config = load_config(args.config, _overrides(args))
    target = RayTarget.choose(args.address or config.ray.address)
    if target.address is None:  # this machine, as a new local Ray would register it (no Ray started)
        plan = preflight(config, local_cluster())
    else:  # every other step before connecting, as `run` does; the fit once the joined cluster is known
        plan = fit_plan(preflight(config, None), _joined_cluster(target))
    config, pools = plan.cfg, plan.pools_line()
    if args.json:
        print(json.dumps({"run_id": config.resolved_run_id(), "config": config.model_dump(mode="json"),
                          "plan": pools, "sized_down": plan.sized, "media": plan.media,
                          "device": plan.device_line()}, indent=2))
    else:
        print(f"{args.config}: valid (run_id={config.resolved_run_id()}, output={config.output.uri})")
        print(f"  input: {_media_text(plan)}")
        print(f"  pools: {pools}" + (" (default CPU shares sized down to fit)" if plan.sized else ""))
        print(f"  implementations: {chosen_text(config)}")
        if device := plan.device_line():  # GPUs asked, none here: the model planned on the CPU
            print(f"  device: {device}")
    return EXIT_OK


def _media_text(plan) -> str:
    """'14 media (parquet metadata)', or 'media unknown until read (csv)' where the source cannot count cheaply."""
    if plan.media is None:
        return f"media unknown until read ({plan.cfg.input.format})"
    return f"{plan.media} media ({plan.source.counted_by()})"


def _overrides(args: argparse.Namespace) -> list[str]:
    """The `--set` overrides, with `--allow-config-change` as `resume.allow_config_change=true`."""
    extra = ["resume.allow_config_change=true"] if getattr(args, "allow_config_change", False) else []
    return [*args.overrides, *extra]


def _joined_cluster(target):
    """The joined Ray's resources now (connected, then disconnected)."""
    import ray

    from vlbatch.jobs.connect import connect, quiet_ray
    from vlbatch.jobs.run_logs import driver_stderr_path, made, state_dir
    from vlbatch.pipeline.plan.cluster import joined_cluster

    with quiet_ray(driver_stderr_path(made(state_dir() / "validate")), False):
        try:
            return joined_cluster(connect(target))
        finally:
            ray.shutdown()


def _slot(args: argparse.Namespace) -> str | None:
    from vlbatch.jobs.scheduling import format_slot, latest_slot

    if args.schedule:
        return format_slot(latest_slot(args.schedule, dt.datetime.now(dt.UTC)))
    return args.slot


def _runtime_env_file(path: str) -> dict:
    from vlbatch.operators.storage.named_file import RUNTIME_ENV, NamedFileError, read_named_file

    try:  # a regular file of at most 1 MiB
        data = yaml.safe_load(read_named_file(path, field="--runtime-env", kind=RUNTIME_ENV).decode("utf-8"))
    except NamedFileError as e:
        raise SubmissionError(str(e)) from None
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise SubmissionError(f"--runtime-env {path}: {e}") from None
    if not isinstance(data, dict):
        raise SubmissionError(f"--runtime-env {path}: expected a mapping (pip, env_vars, image_uri, ...)")
    return data


@_guard
def cmd_submit(args: argparse.Namespace) -> int:
    from vlbatch.jobs.spec import build_spec

    extra = _runtime_env_file(args.runtime_env) if args.runtime_env else None
    bad = [kv for kv in args.env if "=" not in kv]
    if bad:
        raise SubmissionError(f"--env {bad[0]!r}: expected NAME=VALUE")
    env = dict(kv.split("=", 1) for kv in args.env)
    spec = build_spec(
        args.config, workdir=args.workdir, name=args.name, slot=_slot(args), overrides=_overrides(args),
        env=env, runtime_env_extra=extra, entrypoint_num_cpus=args.entrypoint_num_cpus,
    )
    sub = _submitter(args)
    if args.attach:
        sid, action = sub.ensure(spec)
    else:
        sid, action = sub.submit(spec, allow_overlap=args.allow_overlap), "submitted"
    if args.json:
        print(json.dumps({"submission_id": sid, "action": action, "run_id": spec.run_id, "slot": spec.slot}))
    else:
        print(f"{action} {sid} (job {spec.name!r}, slot {spec.slot}, run_id {spec.run_id})", flush=True)
    return _finish(sub, sid, args.follow, args.wait)


@_guard
def cmd_status(args: argparse.Namespace) -> int:
    sub = _submitter(args)
    state = sub.latest(args.submission_id)
    if args.json:
        payload = state.to_json() | {"attempts": [s.to_json() for s in sub.attempts(state.root)]}
        print(json.dumps(payload, indent=2))
    else:
        _print_state(state, False)
    return EXIT_OK


@_guard
def cmd_logs(args: argparse.Namespace) -> int:
    sub = _submitter(args)
    state = sub.latest(args.submission_id)
    if not args.follow:
        _write(sub.logs(state.submission_id))
        return EXIT_OK
    return _finish(sub, state.submission_id, True, False)


@_guard
def cmd_stop(args: argparse.Namespace) -> int:
    sub = _submitter(args)
    state = sub.stop(args.submission_id)
    if state.status not in ("PENDING", "RUNNING"):
        print(f"{state.submission_id} is already {state.status}; nothing to stop")
        return EXIT_OK
    print(f"stop requested for {state.submission_id} (was {state.status})")
    if args.wait:
        final = sub.wait(state.submission_id)
        print(f"{final.submission_id} {final.status}")
    return EXIT_OK


@_guard
def cmd_list(args: argparse.Namespace) -> int:
    states = _submitter(args).list()
    if args.json:
        print(json.dumps([s.to_json() for s in states], indent=2))
        return EXIT_OK
    for s in states:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.start_time)) if s.start_time else "-"
        print(f"{s.submission_id:<48} {s.status:<10} {started}  job={s.job_name} run_id={s.run_id}")
    return EXIT_OK


@_guard
def cmd_resume(args: argparse.Namespace) -> int:
    sub = _submitter(args)
    sid = sub.resume(args.submission_id, workdir=args.workdir)
    if sid is None:
        print(f"{args.submission_id} already succeeded; nothing to resume")
        return EXIT_OK
    print(f"resumed as {sid}", flush=True)
    return _finish(sub, sid, args.follow, args.wait)


# ---- parsers ------------------------------------------------------------------
def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job config YAML (see configs/ and configs/job.schema.json)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config field, e.g. --set sampling.max_tokens=64 (repeatable; value parsed as YAML)",
    )
    p.add_argument(
        "--allow-config-change", action="store_true",
        help="resume a pinned run_id whose answers were made with another config: keep the old rows of the ids "
             "already done, compute the rest with this config (default: refused, naming the changed fields)",
    )


def _address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address",
                   help=f"Ray dashboard / Jobs API address (default: $VLBATCH_ADDRESS or {DEFAULT_ADDRESS})")


def _wait_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", action="store_true", help="wait for the job to end; exit with its result")
    p.add_argument("--follow", action="store_true", help="stream the job's logs until it ends; exit with its result")


def _slot_args(p: argparse.ArgumentParser, what: str) -> None:
    slot = p.add_mutually_exclusive_group()
    slot.add_argument("--slot", help=f"schedule slot, e.g. 20261129T0200 ({what})")
    slot.add_argument("--schedule", metavar="CRON", help="cron expression; the slot is its latest time <= now (UTC)")


def add_job_commands(sub: argparse._SubParsersAction) -> None:
    """The job commands: run and validate here, submit and the submission commands on a cluster."""
    _add_run_and_validate(sub)
    _add_submit(sub)
    _add_submission_commands(sub)


def _add_run_and_validate(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("run", help="run a job here (on a new local Ray unless an address is given)",
                       formatter_class=fmt,
                       description="Run a job in this process. Rerunning the same config resumes it.\n"
                       "The first line names the Ray cluster used, the last what the run produced.\n"
                       "An unreachable cluster, or one that refuses us, is exit 5.")
    _config_args(p)
    p.add_argument("--name", help="job name for the overlap lock (default: config file name)")
    p.add_argument("--address", help="Ray (GCS) address to join, e.g. 10.0.0.5:6379 or auto (the Ray running on "
                                     "this machine); default: ray.address, $RAY_ADDRESS, else a new local Ray")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's own console output (start-up messages, core-worker and Ray Data logs); by default "
                        "it stays in Ray's log files and the run's driver-stderr.log "
                        "(~/.local/state/vlbatch/runs/<run_id>/)")
    p.add_argument("--lock-dir", help="folder of overlap locks (default: $VLBATCH_LOCK_DIR or ~/.cache/vlbatch/locks)")
    p.add_argument("--no-lock", action="store_true", help="do not take the per-job overlap lock")
    _slot_args(p, "run id vlb-<name>-<slot> (unless the config pins output.run_id); default: the config's own")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("validate", help="check a job config, its checkpoint and its pool plan (no Ray started)",
                       formatter_class=fmt,
                       description="The checks `vlbatch run` makes before it starts Ray: the config, local paths, the\n"
                       "checkpoint, and the actor pools against this machine (or, with --address, that cluster).")
    _config_args(p)
    p.add_argument("--address", help="check the pools against this Ray cluster (GCS address, as for run); "
                                     "default: ray.address, $RAY_ADDRESS, else this machine")
    p.add_argument("--json", action="store_true", help="print the resolved config as JSON")
    p.set_defaults(func=cmd_validate)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "submit", help="submit a job to a Ray cluster (Ray Jobs API)", formatter_class=fmt,
        description="Package the working directory and submit the job. The submission id is\n"
        "vlb-<name>-<slot>: a second submission of the same slot is refused (exit 3).",
    )
    _config_args(p)
    _address_arg(p)
    p.add_argument("--name", help="job name (default: config file name)")
    _slot_args(p, "submission id vlb-<name>-<slot>; default: now, to the minute")
    p.add_argument("--workdir", default=".", help="working directory to package (default: .)")
    p.add_argument("--runtime-env", help="YAML file merged into the Ray runtime_env (pip, image_uri, env_vars...)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="environment variable for the job")
    p.add_argument("--entrypoint-num-cpus", type=float, default=1.0, help="CPUs reserved for the driver")
    p.add_argument("--attach", action="store_true",
                   help="if the slot exists: follow it when running, resume it when failed/stopped")
    p.add_argument("--allow-overlap", action="store_true", help="start even if another slot of this job is running")
    p.add_argument("--json", action="store_true", help="print the submission as JSON")
    _wait_args(p)
    p.set_defaults(func=cmd_submit)


def _add_submission_commands(sub: argparse._SubParsersAction) -> None:
    """status, logs, stop, list, resume: each names a submission (or lists them) on a cluster."""
    p = sub.add_parser("status", help="state of a submission (its latest attempt)")
    p.add_argument("submission_id")
    _address_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output, with every attempt")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="logs of a submission's latest attempt")
    p.add_argument("submission_id")
    _address_arg(p)
    p.add_argument("--follow", "-f", action="store_true", help="stream until the job ends; exit with its result")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop a submission's running attempt (resume it later)")
    p.add_argument("submission_id")
    _address_arg(p)
    p.add_argument("--wait", action="store_true", help="wait until it has stopped")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("list", help="vlbatch jobs on the cluster")
    _address_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("resume", help="start the next attempt of a failed or stopped submission")
    p.add_argument("submission_id")
    _address_arg(p)
    p.add_argument("--workdir", default=".", help="working directory to package again (default: .)")
    _wait_args(p)
    p.set_defaults(func=cmd_resume)
