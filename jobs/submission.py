"""Remote jobs through the Ray Jobs API (`ray.job_submission.JobSubmissionClient`).

A vlbatch submission has a deterministic *root* id (`vlb-<name>-<slot>`, see
`vlbatch.jobs.scheduling`). Ray keeps one record per submission id and refuses a second job with
the same id, so the root id is the "at most once per slot" guarantee. Ray jobs cannot be
restarted, so a resume is a new attempt ``<root>-r1``, ``<root>-r2``, ... running the same
entrypoint (same config, same pinned run id), which makes the pipeline skip committed
rows. The *latest attempt* is what status/logs/stop act on when given a root id.

Contract of `Submitter` (the only class that talks to the cluster):
- `submit(spec)`: refuses an existing root (`DuplicateSubmissionError`) and, unless
  allowed, a running job of the same name from another slot (`OverlapError`).
- `ensure(spec)`: the idempotent form for schedulers (Airflow retries, `submit --attach`):
  submit if new, attach if running, resume if failed or stopped, nothing if succeeded.
- `resume(id)`, `stop(id)`, `latest(id)`, `attempts(root)`, `follow(id, write)`, `wait(id)`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlbatch.jobs.errors import (
    ClusterUnreachableError,
    DuplicateSubmissionError,
    JobNotFoundError,
    OverlapError,
    SubmissionError,
)
from vlbatch.jobs.spec import DEFAULT_EXCLUDES, JobSpec

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
ACTIVE = frozenset({"PENDING", "RUNNING"})
_MAX_ATTEMPTS = 1000


def attempt_id(root: str, n: int) -> str:
    """Attempt 0 is the root submission itself; attempt n > 0 is ``<root>-r<n>``."""
    return root if n == 0 else f"{root}-r{n}"


@dataclass(frozen=True)
class JobState:
    """What we report about one Ray job (a small, stable view of Ray's JobDetails)."""

    submission_id: str
    root: str
    attempt: int
    status: str
    message: str | None
    job_name: str | None
    slot: str | None
    run_id: str | None
    start_time: float | None  # seconds since the epoch
    end_time: float | None
    driver_exit_code: int | None
    entrypoint: str

    @classmethod
    def from_details(cls, d: Any) -> JobState:
        meta = d.metadata or {}
        sid = d.submission_id or d.job_id
        root = meta.get("root", sid)
        attempt = int(sid.rsplit("-r", 1)[1]) if sid != root and sid.startswith(root + "-r") else 0
        return cls(
            submission_id=sid,
            root=root,
            attempt=attempt,
            status=str(getattr(d.status, "value", d.status)),
            message=d.message,
            job_name=meta.get("job_name"),
            slot=meta.get("slot"),
            run_id=meta.get("run_id"),
            start_time=d.start_time / 1000 if d.start_time else None,
            end_time=d.end_time / 1000 if d.end_time else None,
            driver_exit_code=getattr(d, "driver_exit_code", None),
            entrypoint=d.entrypoint,
        )

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Submitter:
    """Submits and manages vlbatch jobs on one Ray cluster (dashboard address)."""

    def __init__(self, address: str, *, client: Any | None = None):
        self.address = address
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            from ray.exceptions import AuthenticationError
            from ray.job_submission import JobSubmissionClient

            try:
                self._client = JobSubmissionClient(self.address)
            except (ConnectionError, RuntimeError, AuthenticationError) as e:
                raise ClusterUnreachableError(f"cannot reach the Ray Jobs API at {self.address}: {e}") from None
        return self._client

    # ---- reading ---------------------------------------------------------------
    def _details(self, sid: str) -> Any | None:
        try:
            return self.client.get_job_info(sid)
        except RuntimeError as e:
            if "404" in str(e) or "does not exist" in str(e):
                return None
            raise ClusterUnreachableError(f"Jobs API at {self.address} failed: {e}") from None

    def attempts(self, root: str) -> list[JobState]:
        """Every attempt of a root submission, oldest first (empty if never submitted)."""
        out = []
        for n in range(_MAX_ATTEMPTS):
            d = self._details(attempt_id(root, n))
            if d is None:
                break
            out.append(JobState.from_details(d))
        return out

    def latest(self, sid: str) -> JobState:
        """The latest attempt of the submission `sid` belongs to (root or attempt id)."""
        d = self._details(sid)
        if d is None:
            raise JobNotFoundError(f"no job with submission id {sid!r} on {self.address}")
        root = JobState.from_details(d).root
        return self.attempts(root)[-1]

    def list(self) -> list[JobState]:
        """vlbatch jobs on the cluster (every attempt), newest first."""
        try:
            jobs = self.client.list_jobs()
        except RuntimeError as e:
            raise ClusterUnreachableError(f"Jobs API at {self.address} failed: {e}") from None
        states = [JobState.from_details(d) for d in jobs if (d.metadata or {}).get("vlbatch") == "1"]
        return sorted(states, key=lambda s: s.start_time or 0.0, reverse=True)

    # ---- writing ---------------------------------------------------------------
    def _submit(self, sid: str, entrypoint: str, runtime_env: dict, metadata: dict, num_cpus: float) -> str:
        try:
            return self.client.submit_job(
                entrypoint=entrypoint,
                submission_id=sid,
                runtime_env=runtime_env,
                metadata=metadata,
                entrypoint_num_cpus=num_cpus,
            )
        except RuntimeError as e:
            if "already exists" in str(e):  # lost a race with another submitter of the same slot
                raise DuplicateSubmissionError(f"submission {sid} already exists; not started again") from None
            raise ClusterUnreachableError(f"Jobs API at {self.address} refused the submission: {e}") from None

    def submit(self, spec: JobSpec, *, allow_overlap: bool = False) -> str:
        root = spec.submission_id
        existing = self.attempts(root)
        if existing:
            last = existing[-1]
            raise DuplicateSubmissionError(
                f"submission {root} (job {spec.name!r}, slot {spec.slot}) already exists: latest attempt "
                f"{last.submission_id} is {last.status}. A second copy was not started. Follow it with "
                f"`vlbatch logs {root} --follow`; resume it with `vlbatch resume {root}` if it failed or stopped."
            )
        if not allow_overlap:
            running = [s for s in self.list() if s.job_name == spec.name and s.status in ACTIVE]
            if running:
                raise OverlapError(
                    f"job {spec.name!r} is still running as {running[0].submission_id} (slot {running[0].slot}); "
                    f"not starting slot {spec.slot} beside it (use --allow-overlap to override)"
                )
        return self._submit(root, spec.entrypoint(), spec.runtime_env(), spec.metadata(), spec.entrypoint_num_cpus)

    def resume(self, sid: str, *, workdir: str | Path = ".") -> str | None:
        """Start the next attempt of a failed or stopped submission; None if it already succeeded.

        The working directory is packaged again from `workdir` (Ray may have dropped the
        first upload once its job ended); it must contain the job's config.
        """
        last = self.latest(sid)
        if last.status == "SUCCEEDED":
            return None
        if last.status in ACTIVE:
            raise OverlapError(f"{last.submission_id} is still {last.status}; stop it before resuming")
        d = self._details(last.submission_id)
        meta = dict(d.metadata or {})
        wd = Path(workdir).resolve()
        if not (wd / meta.get("config", "")).is_file():
            raise SubmissionError(f"resume: config {meta.get('config')!r} not found under working directory {wd}")
        runtime_env = dict(d.runtime_env or {})
        runtime_env["working_dir"] = str(wd)
        runtime_env["excludes"] = sorted(set(runtime_env.get("excludes") or []) | set(DEFAULT_EXCLUDES))
        meta["resume_of"] = last.submission_id
        new_id = attempt_id(last.root, last.attempt + 1)
        return self._submit(new_id, d.entrypoint, runtime_env, meta, float(meta.get("entrypoint_num_cpus", "1")))

    def ensure(self, spec: JobSpec) -> tuple[str, str]:
        """Idempotent submit for schedulers -> (submission id to follow, action taken).

        action: ``submitted`` | ``attached`` (already running) | ``resumed`` | ``done``.
        """
        existing = self.attempts(spec.submission_id)
        if not existing:
            return self._submit(
                spec.submission_id, spec.entrypoint(), spec.runtime_env(), spec.metadata(), spec.entrypoint_num_cpus
            ), "submitted"
        last = existing[-1]
        if last.status in ACTIVE:
            return last.submission_id, "attached"
        if last.status == "SUCCEEDED":
            return last.submission_id, "done"
        return self.resume(last.submission_id, workdir=spec.workdir) or last.submission_id, "resumed"

    def stop(self, sid: str) -> JobState:
        last = self.latest(sid)
        if last.status in ACTIVE:
            self.client.stop_job(last.submission_id)
        return last

    def wait(self, sid: str, *, timeout_s: float | None = None, poll_s: float = 1.0) -> JobState:
        """Poll the Jobs API until the attempt `sid` is terminal (or `timeout_s` passes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            d = self._details(sid)
            if d is None:
                raise JobNotFoundError(f"no job with submission id {sid!r} on {self.address}")
            state = JobState.from_details(d)
            if state.status in TERMINAL or (deadline is not None and time.monotonic() > deadline):
                return state
            time.sleep(poll_s)

    def follow(self, sid: str, write: Callable[[str], None]) -> JobState:
        """Stream the attempt's logs to `write` until it ends; returns its final state."""

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(sid):
                write(chunk)

        try:
            asyncio.run(tail())
        except (RuntimeError, OSError) as e:  # the stream broke (e.g. head restarted): fall back to polling
            write(f"[vlbatch] log stream interrupted ({e}); waiting for the job to end\n")
        return self.wait(sid)

    def logs(self, sid: str) -> str:
        return self.client.get_job_logs(sid)
