"""What a submitted job is: a validated config, a name, a slot, a run id, and how to start it.

`build_spec` validates the job config locally (no Ray) before anything is sent, so a bad
config never reaches a cluster. The job runs on the cluster as our own CLI
(``python -m vlbatch.jobs.cli run CONFIG --set ... --set output.run_id=RUN``) inside the packaged
working directory; pinning the run id on the command line makes every attempt of the same
submission (the first, a resume after a stop, an Airflow retry) write to and resume the
same output folder.

Run id rule: the config's ``output.run_id`` if set; else, for a scheduled submission
(a slot was given), the submission id, so each slot gets its own output; else the
config's content hash (`JobConfig.resolved_run_id`).
"""
from __future__ import annotations

import datetime as dt
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from vlbatch.jobs.errors import SubmissionError
from vlbatch.jobs.scheduling import format_slot, submission_id

# Never packaged with the working directory: VCS data, caches, local outputs, venvs.
DEFAULT_EXCLUDES = (
    ".git", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", "*.egg-info",
    "out", "tmp", ".venv*", "venv", ".deps", ".whl", ".gl", "build", "dist",
)


@dataclass(frozen=True)
class JobSpec:
    """One submission, fully resolved. `config` is relative to `workdir` (POSIX form)."""

    name: str
    slot: str
    config: str
    overrides: tuple[str, ...]
    run_id: str
    workdir: Path
    env: tuple[tuple[str, str], ...] = ()
    runtime_env_extra: dict = field(default_factory=dict, hash=False, compare=False)
    entrypoint_num_cpus: float = 1.0

    @property
    def submission_id(self) -> str:
        return submission_id(self.name, self.slot)

    def entrypoint(self) -> str:
        # --no-lock: on a cluster, overlap is guarded at submission (see Submitter.submit).
        args = ["python", "-m", "vlbatch.jobs.cli", "run", self.config, "--name", self.name, "--no-lock"]
        for ov in self.overrides:
            args += ["--set", ov]
        args += ["--set", f"output.run_id={self.run_id}"]
        return shlex.join(args)

    def runtime_env(self) -> dict:
        env = dict(self.runtime_env_extra)
        env_vars = {**env.get("env_vars", {}), "PYTHONUNBUFFERED": "1", **dict(self.env)}
        env_vars["VLBATCH_SUBMISSION_ROOT"] = self.submission_id
        env["env_vars"] = env_vars
        env["working_dir"] = str(self.workdir)
        env["excludes"] = sorted(set(env.get("excludes", [])) | set(DEFAULT_EXCLUDES))
        return env

    def metadata(self) -> dict[str, str]:
        """String metadata stored with the Ray job; `resume` and `list` read it back."""
        return {
            "vlbatch": "1",
            "job_name": self.name,
            "slot": self.slot,
            "run_id": self.run_id,
            "config": self.config,
            "overrides": json.dumps(list(self.overrides)),
            "root": self.submission_id,
            "entrypoint_num_cpus": str(self.entrypoint_num_cpus),
        }


def _relative_config(config_path: Path, workdir: Path) -> str:
    cfg = config_path.resolve()
    try:
        return cfg.relative_to(workdir.resolve()).as_posix()
    except ValueError:
        raise SubmissionError(
            f"config {config_path} is outside the working directory {workdir}; only the working "
            "directory is shipped to the cluster (move the config into it or pass --workdir)"
        ) from None


def build_spec(
    config_path: str | Path,
    *,
    workdir: str | Path = ".",
    name: str | None = None,
    slot: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    env: dict[str, str] | None = None,
    runtime_env_extra: dict | None = None,
    entrypoint_num_cpus: float = 1.0,
) -> JobSpec:
    """Validate the config (raises `ConfigError`) and resolve name, slot, run id and paths.

    Without a slot (an ad-hoc submission) the slot is the current UTC minute and the run id
    is the config's own (so resubmitting the same config resumes the same output).
    """
    from vlbatch.pipeline.config import load_config

    wd = Path(workdir).resolve()
    if not wd.is_dir():
        raise SubmissionError(f"working directory {workdir} does not exist")
    cfg_path = Path(config_path)
    rel = _relative_config(cfg_path, wd)
    config = load_config(cfg_path, list(overrides))
    job_name = name or cfg_path.stem
    scheduled = slot is not None
    slot = slot if scheduled else format_slot(dt.datetime.now(dt.UTC))
    sid = submission_id(job_name, slot)
    run_id = config.output.run_id or (sid if scheduled else config.resolved_run_id())
    return JobSpec(
        name=job_name,
        slot=slot,
        config=rel,
        overrides=tuple(overrides),
        run_id=run_id,
        workdir=wd,
        env=tuple(sorted((env or {}).items())),
        runtime_env_extra=dict(runtime_env_extra or {}),
        entrypoint_num_cpus=entrypoint_num_cpus,
    )
