"""Errors of the jobs layer (CLI, submission, scheduling) and their exit codes.

Each error maps to one documented exit code of the `vlbatch` command (see `vlbatch.jobs.cli`).
They subclass `vlbatch.operators.errors.VlbatchError` so callers can catch one base class.
"""
from __future__ import annotations

from vlbatch.operators.errors import VlbatchError

# Exit codes of `vlbatch` (documented in jobs/cli.py and the README).
EXIT_OK = 0
EXIT_JOB_FAILED = 1  # the job ran and failed (or passed both max_error_fraction and min_error_rows)
EXIT_USAGE = 2  # bad usage, invalid config or storage the start-up checks cannot reach; nothing was started
EXIT_DUPLICATE = 3  # a submission with this id (job name + slot) already exists
EXIT_NOT_FOUND = 4  # no job with this submission id on the cluster
EXIT_UNREACHABLE = 5  # the Ray cluster (GCS for `run`, Jobs API otherwise) unreachable or refusing us
EXIT_OVERLAP = 6  # another run of the same job is still running (lock held)
EXIT_STOPPED = 7  # the job was stopped before it finished
EXIT_SETUP_FAILED = 8  # an actor could not start (model / processor load, a checkpoint download, out of memory)
EXIT_SIGINT = 130  # `vlbatch run` interrupted by Ctrl-C (SIGINT); rerun to resume
EXIT_SIGTERM = 143  # `vlbatch run` stopped by SIGTERM (a scheduler); rerun to resume
EXIT_BROKEN_PIPE = 141  # stdout closed early (128 + SIGPIPE, what a shell reports for `yes | head`)


class JobsError(VlbatchError):
    """Base of the jobs layer; `exit_code` is what the CLI returns for it."""

    exit_code: int = EXIT_JOB_FAILED


class DuplicateSubmissionError(JobsError):
    """A job with the same submission id (job name + schedule slot) was already submitted."""

    exit_code = EXIT_DUPLICATE


class JobNotFoundError(JobsError):
    exit_code = EXIT_NOT_FOUND


class ClusterUnreachableError(JobsError):
    """The Ray cluster did not answer, or refused the connection (e.g. token authentication)."""

    permanent = False
    exit_code = EXIT_UNREACHABLE


class OverlapError(JobsError):
    """Another run of the same job holds the lock (local) or is running (cluster)."""

    permanent = False
    exit_code = EXIT_OVERLAP


class SubmissionError(JobsError):
    """The submission request itself is wrong (e.g. config outside the working dir)."""

    exit_code = EXIT_USAGE
