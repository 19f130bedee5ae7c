"""The one preflight: the ordered checks `vlbatch validate` and `vlbatch run` both run, once each.

    STEPS = paths -> input -> checkpoint -> output -> fit

1. `paths`: the config's local paths (`plan/checks.check_paths`: model folder, input, decoder, output folder);
2. `input`: the run's `Source` opened, its configured columns checked against the input's schema
   (`Source.check`: bounded reads) and counted (a manifest listed in the driver, no Ray): `check_input`;
3. `checkpoint`: what a model or CPU actor would die on (`plan/checkpoint.check_model`);
4. `output`: the output bucket exists (`plan/fingerprint.check_output`) and the run folder's answers were
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

from vlbatch.operators.errors import StorageCheckError, StorageError
from vlbatch.operators.storage import StorageOptions, join
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.plan.checkpoint import check_model
from vlbatch.pipeline.plan.checks import check_paths
from vlbatch.pipeline.plan.cluster import Cluster
from vlbatch.pipeline.plan.fingerprint import check_fingerprint, check_output
from vlbatch.pipeline.plan.fit import check_plan
from vlbatch.pipeline.plan.spec import RunPlace, RunPlan, plan
from vlbatch.pipeline.sources import open_source

STEPS = ("paths", "input", "checkpoint", "output", "fit")  # the order `preflight` runs them in


def preflight(cfg: JobConfig, cluster: Cluster | None) -> RunPlan:
    """`STEPS` in order (`fit` only when `cluster` is known: else `fit_plan` later) -> the checked plan.
    The run id and the storage options are made once here and handed to each step and the plan (`RunPlace`);
    each step is called from here (no callbacks, no context managers), so the walk enters this module once."""
    sections, run_id, formats = cfg.answer_basis()  # the run id, its and the fingerprint's basis, the formats
    storage = StorageOptions.of(cfg.storage)
    check_paths(cfg, run_id)  # paths
    source, media = check_input(cfg, storage)  # input
    _guarded("model.path", check_model, cfg, storage, formats)  # checkpoint
    _guarded("output.uri", check_output, cfg, storage)  # output: a missing bucket is a ConfigError now ...
    note = _guarded("output.uri", check_fingerprint, cfg, run_id, storage, sections)  # ... another config's answers
    sized = None
    if cluster is not None:  # else a joined Ray, not connected yet: the GPUs as configured
        cfg, sized = check_plan(cfg, cluster)  # fit
    run = RunPlace(run_id, join(cfg.output.uri.rstrip("/"), run_id), storage, note)
    return plan(cfg, cluster, source=source, media=media, sized=sized, run=run)


def check_input(cfg: JobConfig, storage=None):
    """The `input` step: (the run's `Source`, its media count or None: unknown until read). One source per
    run: its listing and first schema read once; its configured columns checked (`Source.check`)."""
    return _guarded("input.uri", _opened, cfg, storage)


def _opened(cfg: JobConfig, storage):
    source = open_source(cfg, storage)
    source.check()
    return source, source.count()


def _guarded(field: str, step, *args):
    """`step(*args)`; a storage failure on the way -> one `StorageCheckError` line naming `field` (exit 2):
    `StorageError` (transient ones after the retries) and what the retries re-raise as it is (no
    credentials: botocore's `NoCredentialsError`; denied, not found: `OSError`s)."""
    try:
        return step(*args)
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
    return plan(cfg, cluster, source=p.source, media=p.media, sized=sized, run=p.run)
