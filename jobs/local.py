"""Running a job in this process: `vlbatch run` (also the entrypoint of submitted jobs).

Order of work: validate the config (no Ray), take the job's overlap lock, connect to Ray,
run the pipeline (`vlbatch.pipeline.runner.run_job`), turn its summary into an exit code.

Which Ray: ``--address`` or the config's ``ray.address`` when set; else ``RAY_ADDRESS``
(set by Ray for submitted jobs, so they run on their cluster); else a Ray already running
on this machine (``address="auto"``); else a new local Ray started for this run and shut
down with it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from vlbatch.jobs.errors import EXIT_JOB_FAILED, EXIT_OK
from vlbatch.jobs.scheduling import run_lock, submission_id


def connect_ray(address: str | None) -> bool:
    """Connect this process to Ray; returns True when we started a new local Ray."""
    import ray

    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, **quiet)  # address None: Ray reads RAY_ADDRESS
        return False
    try:
        ray.init(address="auto", **quiet)  # join a Ray already running on this machine
        return False
    except ConnectionError:
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, **quiet)
        return True


def summary_exit_code(summary: Any) -> int:
    """RunSummary -> exit code. The runner decides failure (error share over
    ``max_error_fraction``: 1, else 0); we pass its verdict on, never recompute it."""
    return EXIT_JOB_FAILED if summary.exit_code else EXIT_OK


def run_local(
    config_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    name: str | None = None,
    address: str | None = None,
    slot: str | None = None,
    lock_dir: Path | None = None,
    use_lock: bool = True,
) -> int:
    """Run one job to completion here; raises ConfigError / OverlapError before any work.

    With a `slot` (cron / RayCronJob runs) the run id is ``vlb-<name>-<slot>`` unless the
    config pins one, so every retry of the same tick resumes the same output.
    """
    from vlbatch.pipeline.config import load_config

    config = load_config(config_path, list(overrides))
    job_name = name or Path(config_path).stem
    if slot is not None and not config.output.run_id:  # a scheduled run: one output per slot
        config = load_config(config_path, [*overrides, f"output.run_id={submission_id(job_name, slot)}"])
    print(f"[vlbatch] job {job_name!r} run_id={config.resolved_run_id()} output={config.output.uri}", flush=True)
    if not use_lock:
        return _run(config, address)
    with run_lock(job_name, lock_dir):
        return _run(config, address)


def _run(config: Any, address: str | None) -> int:
    from vlbatch.pipeline.runner import run_job

    started = connect_ray(address or config.ray.address)
    try:
        summary = run_job(config)
    finally:
        if started:
            import ray

            ray.shutdown()
    return summary_exit_code(summary)
