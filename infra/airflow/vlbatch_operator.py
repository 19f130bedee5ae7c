"""`VlbatchJobOperator`: run one vlbatch job on a Ray cluster from Airflow.

Why this design (the Astronomer Ray provider was archived in July 2026):
- It rests on two maintained pieces only: Airflow's own `BaseOperator` and Ray's
  `JobSubmissionClient` (part of Ray itself, the same API `ray job submit` uses), reached
  through `vlbatch.jobs.submission.Submitter`, the code path the `vlbatch` CLI uses.
- An operator (not a bare `@task`) so that `on_kill` can stop the Ray job when Airflow
  kills or times out the task; a plain PythonOperator would leave it running.
- Not a BashOperator around `vlbatch submit --follow`: killing the shell would orphan the
  Ray job, and the task's result (submission id, run id, status) would not reach XCom.
- Not KubernetesPodOperator: it needs Kubernetes; this works with any Ray cluster.

Behaviour: the submission id is `vlb-<job_name>-<slot>` with the slot taken from the
run's logical date (else its run_after), so a retry of the same task instance asks for
the same id. `Submitter.ensure` then attaches to a running attempt, resumes a failed or
stopped one (same run id: committed rows are skipped), or returns at once if it already
succeeded. The job's logs stream into the task log; any end state but SUCCEEDED fails
the task (and Airflow's retries resume it).

Needs in the Airflow environment: `ray[default]` (Jobs client), pydantic and pyyaml, and
the vlbatch source importable (`pip install --no-deps vlbatch` or PYTHONPATH) for the
`jobs` and `vlbatch.pipeline.config` modules; torch is not needed there.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

try:  # Airflow 3
    from airflow.sdk import BaseOperator
except ImportError:  # Airflow 2.10/2.11
    from airflow.models import BaseOperator

log = logging.getLogger(__name__)


class VlbatchJobFailed(RuntimeError):
    """The Ray job ended in a state other than SUCCEEDED (fails the Airflow task)."""


class VlbatchJobOperator(BaseOperator):
    template_fields: Sequence[str] = ("config", "workdir", "address", "job_name", "overrides")

    def __init__(
        self,
        *,
        config: str,
        address: str,
        workdir: str = ".",
        job_name: str | None = None,
        overrides: list[str] | None = None,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.config = config
        self.address = address
        self.workdir = workdir
        self.job_name = job_name
        self.overrides = overrides or []
        self.env = env or {}
        self._submission_id: str | None = None

    def _slot(self, context: Any) -> str:
        from vlbatch.jobs.scheduling import format_slot

        when = context.get("logical_date") or context["dag_run"].run_after
        return format_slot(when)

    def execute(self, context: Any) -> dict:
        from vlbatch.jobs.spec import build_spec
        from vlbatch.jobs.submission import Submitter

        spec = build_spec(
            self.config, workdir=self.workdir, name=self.job_name, slot=self._slot(context),
            overrides=list(self.overrides), env=self.env,
        )
        sub = Submitter(self.address)
        sid, action = sub.ensure(spec)
        self._submission_id = sid
        log.info("vlbatch: %s %s (run_id %s) on %s", action, sid, spec.run_id, self.address)
        state = sub.follow(sid, _LineLogger(log))
        log.info("vlbatch: %s ended %s: %s", sid, state.status, state.message)
        if state.status != "SUCCEEDED":
            raise VlbatchJobFailed(f"Ray job {sid} ended {state.status}: {state.message}")
        return {"submission_id": sid, "root": state.root, "run_id": spec.run_id, "status": state.status}

    def on_kill(self) -> None:
        if self._submission_id:
            from vlbatch.jobs.submission import Submitter

            Submitter(self.address).stop(self._submission_id)
            log.info("vlbatch: stopped %s", self._submission_id)


class _LineLogger:
    """Log chunks from the Ray log stream as whole lines (chunks split lines arbitrarily)."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.buf = ""

    def __call__(self, chunk: str) -> None:
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self.logger.info("[ray job] %s", line)
