"""The plan's pools against the cluster (`plan/cluster.py`): `fit_defaults`, `fit_problems`, `check_fit`.

    cfg, sized = fit_defaults(cfg, cluster)   # pools the user did not size, shrunk to fit the machine
    check_fit(cfg, cluster)                   # ConfigError on a fixed-size cluster, one warning otherwise

The pools are the plan's (`plan/spec.pools`: the CPU pools, fused or not, none but preprocess in scan
mode; the model pool, every rank of a replica; the write pool; each at `min_actors`; plus the streamed
manifest read). Each actor's CPUs, GPUs and memory are summed and set against the cluster's. A local
Ray (`fixed_size`) never grows, so a pool that does not fit would wait forever (no commit, no
progress): refused, naming the fields. A joined cluster may add nodes (autoscaling): one warning line.

Defaults fit the machine: a stage whose `num_cpus` the config does not set is sized down (all
such stages by one factor, to 0.01 CPU) until the plan fits, e.g. on a 2-CPU machine the
default 2.30 CPUs become 1.98. What the user set is never changed, only refused.
"""
from __future__ import annotations

import logging
import math

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.plan.cluster import GIB, Cluster
from vlbatch.pipeline.plan.spec import cpu_fallback, pools

log = logging.getLogger("vlbatch.pipeline")

RESOURCE_UNIT = 1e-4  # Ray's resource granularity: quantities are multiples of this
MIN_STAGE_CPUS = 0.01


def _user_sized(cfg: JobConfig, stage: str) -> bool:
    """Whether the config sets `resources.<stage>.num_cpus` (a default section's values are not the user's)."""
    return stage in cfg.resources.model_fields_set and "num_cpus" in getattr(cfg.resources, stage).model_fields_set


def fit_defaults(cfg: JobConfig, cluster: Cluster) -> tuple[JobConfig, dict[str, float]]:
    """`cfg` with the CPU shares of the stages the user did not size lowered (one factor for all,
    floored to 0.01 CPU) so the plan fits `cluster`'s CPUs; -> (config, {stage: new num_cpus}),
    {} when nothing changed (it fits, or nothing is the defaults' to lower)."""
    plan = pools(cfg, cluster)
    need = sum(p.actor_cpus * p.min_actors for p in plan)
    if not cluster.cpus or need <= cluster.cpus + RESOURCE_UNIT:
        return cfg, {}
    ours = [p for p in plan if p.field.startswith("resources.") and not _user_sized(cfg, p.field.split(".")[1])]
    movable = sum(p.actor_cpus * p.min_actors for p in ours)
    room = cluster.cpus - (need - movable)
    if not ours or room <= 0:
        return cfg, {}
    factor = room / movable
    sized = {}
    for p in ours:  # per actor (the model: per rank)
        stage = p.field.split(".")[1]
        sized[stage] = max(MIN_STAGE_CPUS, math.floor(getattr(cfg.resources, stage).num_cpus * factor * 100) / 100)
    res = cfg.resources.model_copy(update={s: getattr(cfg.resources, s).model_copy(update={"num_cpus": c})
                                           for s, c in sized.items()})
    fitted = cfg.model_copy(update={"resources": res})
    if sum(p.actor_cpus * p.min_actors for p in pools(fitted, cluster)) > cluster.cpus + RESOURCE_UNIT:
        return cfg, {}  # even at the floor it does not fit: check_fit says why
    return fitted, sized


def fit_problems(cfg: JobConfig, cluster: Cluster) -> list[str]:
    """Each way the plan cannot run on `cluster`, one line naming the fields; [] when it fits."""
    plan = pools(cfg, cluster)
    problems = []
    on = f"{cluster.where} has"
    cpus = sum(p.actor_cpus * p.min_actors for p in plan)
    if cluster.cpus and cpus > cluster.cpus + RESOURCE_UNIT:
        parts = ", ".join(f"{p.field} {p.min_actors}x{p.actor_cpus:g}" for p in plan)
        problems.append(f"resources: the actor pools at min_actors and the manifest read need {cpus:.2f} CPUs but "
                        f"{on} {cluster.cpus:g} ({parts}); lower resources.*.num_cpus or min_actors")
    gpus = sum(p.actor_gpus * p.min_actors for p in plan)
    m = cfg.model
    if not cluster.gpus and cfg.task.mode != "scan" and m.device == "cuda":
        problems.append(f"model.device: cuda but {on} no GPU (use model.device=auto or cpu)")
    elif gpus > cluster.gpus:
        problems.append(f"resources.model.num_gpus: the model pool needs {gpus:g} GPUs "
                        f"({m.tensor_parallel_size} rank(s) x {cfg.resources.model.num_gpus:g} x "
                        f"{cfg.resources.model.min_actors} replica(s)) but {on} {cluster.gpus:g}")
    memory = sum(p.actor_memory * p.min_actors for p in plan)
    if memory > cluster.memory_bytes:
        big = ", ".join(f"{p.field}.memory_gb" for p in plan if p.actor_memory)
        problems.append(f"{big}: the actor pools reserve {memory / GIB:.1f} GiB but {on} "
                        f"{cluster.memory_bytes / GIB:.1f} GiB for Ray's actors")
    return problems


def problems_error(problems: list[str]) -> ConfigError:
    """One ConfigError for the problems: one line for one problem, else one line each after a header."""
    if len(problems) == 1:
        return ConfigError(f"invalid job config: {problems[0]}")
    return ConfigError("invalid job config:\n  " + "\n  ".join(problems))


def check_fit(cfg: JobConfig, cluster: Cluster) -> None:
    """ConfigError naming every field that does not fit a fixed-size cluster; on a cluster that
    may grow, one warning line per problem (later stages wait until nodes are added)."""
    problems = fit_problems(cfg, cluster)
    if not problems:
        return
    if cluster.fixed_size:
        raise problems_error(problems)
    for p in problems:
        log.warning("%s (waiting for the cluster to add nodes)", p)


def device_problems(config: JobConfig, cluster: Cluster) -> list[str]:
    """The engine's settings against the device the model actor gets (with no GPU on `cluster` and
    none an autoscaler is known to add, `device: auto` runs the model on the CPU: `plan/spec.model_gpus`)."""
    m, r = config.model, config.resources.model
    on_cpu = m.device == "cpu" or (m.device == "auto" and (r.num_gpus == 0 or cpu_fallback(config, cluster)))
    if m.backend != "engine" or not on_cpu:
        return []
    cuda_only = (("attention", m.engine.attention, "triton"), ("delta_rule", m.engine.delta_rule, "fla"))
    return [f"model.engine.{field}: {kernel} is a CUDA kernel but the model runs on the CPU (use auto, or give "
            "the model a GPU: model.device=cuda, resources.model.num_gpus)"
            for field, chosen, kernel in cuda_only if chosen == kernel]


def gpu_problems(config: JobConfig, cluster: Cluster) -> list[str]:
    """A joined cluster with no GPU node and no autoscaler that can add one, for a model asking GPUs
    with `device: auto`: refused (on this machine the model runs on the CPU, said in one line:
    `RunPlan.device_line`; an autoscaler whose node types are unknown is given the benefit of the doubt)."""
    if cluster.fixed_size or cluster.may_add_gpus is not False or config.task.mode == "scan" \
            or not cpu_fallback(config, cluster):
        return []
    return [f"resources.model.num_gpus: {config.resources.model.num_gpus:g} but {cluster.where} has no GPU node and "
            "no autoscaler that can add one (set resources.model.num_gpus=0 to run the model on the CPU there, "
            "or join a cluster with GPU nodes)"]


def check_plan(config: JobConfig, cluster: Cluster) -> tuple[JobConfig, dict[str, float]]:
    """The preflight's `fit` step (`plan/preflight.py`): a GPU the cluster can never give, the engine
    against the device, the pool plan against the cluster's CPUs, GPUs and memory. -> (the config to
    run, with the default pools sized to the cluster; {stage: num_cpus} of what was sized down). One
    ConfigError names every problem;
    on a cluster that may grow, what does not fit now is a warning (`check_fit`)."""
    fitted, sized = fit_defaults(config, cluster)
    problems = gpu_problems(fitted, cluster) + device_problems(fitted, cluster)
    if cluster.fixed_size:
        problems += fit_problems(fitted, cluster)
    if problems:
        raise problems_error(problems)
    check_fit(fitted, cluster)  # warnings only, on a cluster that may grow
    return fitted, sized
