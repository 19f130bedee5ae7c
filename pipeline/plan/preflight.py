"""The one preflight: the ordered checks `vlbatch validate` and `vlbatch run` both run, once each.

    STEPS = paths -> input -> checkpoint -> output -> fit

1. `paths`: the config's local paths (`plan/checks.check_paths`: model folder, input, decoder, output folder);
2. `input`: the run's `Source` opened, its configured columns checked against the input's schema
   (`Source.check`: bounded reads) and counted (a manifest listed in the driver, no Ray): `check_input`;
3. `checkpoint`: what a model or CPU actor would die on (`plan/checkpoint.check_model`);
4. `output`: the output bucket exists (`plan/checks.check_output`) and the run folder's answers were
   made with this config (`plan/fingerprint.check_fingerprint`);
5. `fit`: the engine against the device the model gets, the pools against the cluster's CPUs, GPUs
   and memory, default CPU shares sized down to fit (`plan/fit.py`): needs the `Cluster`.

`preflight(cfg, cluster)` runs them in that order and returns the checked `RunPlan` (`plan/spec.py`),
which `pipeline/graph.run_job` runs without checking anything again. The cluster of a joined Ray is
known only once connected: `preflight(cfg, None)` stops before `fit` (its plan's `cluster` None, the
GPUs as configured) and `fit_plan(plan, cluster)` runs the rest, once connected. A problem is one
`ConfigError` naming the fields, before any Ray process starts (for a joined Ray, before the graph).
Storage that a step cannot reach (no credentials, an endpoint that does not answer) is a
`StorageCheckError` (a `ConfigError`: exit 2, nothing started) naming the step's field: `input.uri`,
`model.path` or `output.uri`, and the cause.
"""
from __future__ import annotations

from contextlib import contextmanager

from vlbatch.operators.errors import StorageCheckError, StorageError
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.plan.checkpoint import check_model
from vlbatch.pipeline.plan.checks import check_output, check_paths
from vlbatch.pipeline.plan.cluster import Cluster
from vlbatch.pipeline.plan.fingerprint import check_fingerprint
from vlbatch.pipeline.plan.fit import check_plan
from vlbatch.pipeline.plan.spec import RunPlan, plan
from vlbatch.pipeline.sources import open_source

STEPS = ("paths", "input", "checkpoint", "output", "fit")  # the order `preflight` runs them in


def preflight(cfg: JobConfig, cluster: Cluster | None) -> RunPlan:
    """`STEPS` in order (`fit` only when `cluster` is known: else `fit_plan` later) -> the checked plan.
    Each step calls its module directly, so the walk (scripts/walk_calls.py) enters this module once."""
    check_paths(cfg)  # paths
    source, media = check_input(cfg)  # input
    with _storage("model.path"):
        check_model(cfg)  # checkpoint
    with _storage("output.uri"):
        check_output(cfg)  # output: a missing bucket is a ConfigError now, never a new bucket ...
        check_fingerprint(cfg)  # ... and answers made with another config under this run id too
    if cluster is None:  # a joined Ray, not connected yet: the GPUs as configured
        return plan(cfg, None, source=source, media=media)
    cfg, sized = check_plan(cfg, cluster)  # fit
    return plan(cfg, cluster, source=source, media=media, sized=sized)


def check_input(cfg: JobConfig):
    """The `input` step: (the run's `Source`, its media count or None: unknown until read). One source per
    run: its listing and first schema read once; its configured columns checked (`Source.check`)."""
    with _storage("input.uri"):
        source = open_source(cfg)
        source.check()
        return source, source.count()


@contextmanager
def _storage(field: str):
    """A storage failure of the step checking `field` -> one `StorageCheckError` line naming it (exit 2):
    `StorageError` (transient ones after the retries) and what the retries re-raise as it is (no
    credentials: botocore's `NoCredentialsError`; denied, not found: `OSError`s)."""
    try:
        yield
    except _storage_errors() as e:
        raise StorageCheckError(f"{field}: the storage check failed: {type(e).__name__}: {e} (check the URI, "
                                "the credentials and the storage section)") from None


def _storage_errors() -> tuple[type[BaseException], ...]:
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # no S3 support installed: no botocore errors either
        return StorageError, OSError
    return StorageError, OSError, BotoCoreError, ClientError


def fit_plan(p: RunPlan, cluster: Cluster) -> RunPlan:
    """The step a `preflight(cfg, None)` left (`fit`), on `cluster` now known (connected)."""
    cfg, sized = check_plan(p.cfg, cluster)
    return plan(cfg, cluster, source=p.source, media=p.media, sized=sized)
