"""The one preflight: the ordered checks `vlbatch validate` and `vlbatch run` both run, once each.

    STEPS = paths -> input -> checkpoint -> output -> fit

1. `paths`: the config's local paths (`plan/checks.check_paths`: model folder, input, decoder, output folder);
2. `input`: the run's `Source` opened and counted (a manifest listed in the driver, no Ray);
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
"""
from __future__ import annotations

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
    source = open_source(cfg)  # input: one per run, its listing and first schema read once
    media = source.count()
    check_model(cfg)  # checkpoint
    check_output(cfg)  # output: a missing bucket is a ConfigError now, never a new bucket ...
    check_fingerprint(cfg)  # ... and answers made with another config under this run id too
    if cluster is None:  # a joined Ray, not connected yet: the GPUs as configured
        return plan(cfg, None, source=source, media=media)
    cfg, sized = check_plan(cfg, cluster)  # fit
    return plan(cfg, cluster, source=source, media=media, sized=sized)


def fit_plan(p: RunPlan, cluster: Cluster) -> RunPlan:
    """The step a `preflight(cfg, None)` left (`fit`), on `cluster` now known (connected)."""
    cfg, sized = check_plan(p.cfg, cluster)
    return plan(cfg, cluster, source=p.source, media=p.media, sized=sized)
