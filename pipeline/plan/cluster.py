"""The pool plan against the cluster a run would use: what `vlbatch validate` and the start of
`vlbatch run` compute before the graph starts (the checkpoint half is `pipeline/plan/checkpoint.py`).

    cluster = local_cluster()            # a new local Ray: what it would register, no process started
    cluster = joined_cluster(address)    # a Ray joined by --address / ray.address (connected first)
    cfg, sized = fit_defaults(cfg, cluster)   # pools the user did not size, shrunk to fit the machine
    check_fit(cfg, cluster)              # ConfigError on a fixed-size cluster, one warning otherwise

The plan is the one `runner.build_graph` asks Ray for: the CPU pools (fused or not, none
but preprocess in scan mode), the model pool (every rank of a replica: `replica_resources`),
the write pool, each at `min_actors`, plus the streamed manifest read. Each actor's CPUs,
GPUs and memory are summed and set against the cluster's. A local Ray (`fixed_size`) never
grows, so a pool that does not fit would wait forever (no commit, no progress): refused, naming
the fields. A joined cluster may add nodes (autoscaling): one warning line instead.

Defaults fit the machine: a stage whose `num_cpus` the config does not set is sized down (all
such stages by one factor, to 0.01 CPU) until the plan fits, e.g. on a 2-CPU machine the
default 2.30 CPUs become 1.98. What the user set is never changed, only refused.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import JobConfig, StageResources

log = logging.getLogger("vlbatch.pipeline")

GIB = 2**30
RESOURCE_UNIT = 1e-4  # Ray's resource granularity: quantities are multiples of this
MIN_STAGE_CPUS = 0.01


@dataclass(frozen=True)
class Cluster:
    """The resources a run's actors may reserve. `fixed_size`: a local Ray started for the run
    (never grows); `where`: how lines name it."""

    cpus: float
    gpus: float
    memory_bytes: int
    fixed_size: bool
    where: str


@dataclass(frozen=True)
class Pool:
    """One actor pool at its minimum size: `actors` actors of (cpus, gpus, memory_bytes) each.
    `field`: the config section that sizes it (resources.<stage>)."""

    field: str
    actors: int
    cpus: float
    gpus: float = 0.0
    memory_bytes: int = 0


OBJECT_STORE_SHARE = 0.3  # a local Ray's object store takes this share of the available memory ...
OBJECT_STORE_MAX = 200 * GIB  # ... up to this (Ray's defaults); its `memory` resource is the rest


def local_cluster() -> Cluster:
    """What a new local Ray on this machine registers, computed as Ray does it without starting a
    process (and without Ray's private API): the machine's CPUs (within a cgroup quota), the GPUs CUDA_VISIBLE_DEVICES or nvidia-smi lists, and the `memory` resource (the
    available memory less the object store)."""
    cpus = float(os.cpu_count() or 1)  # as Ray counts them (not the affinity mask)
    quota = _cgroup_cpus()
    if quota is not None:
        cpus = min(cpus, quota)
    available = _available_memory()
    memory = available - min(int(available * OBJECT_STORE_SHARE), OBJECT_STORE_MAX)
    return Cluster(cpus, float(_visible_gpus()), int(memory), True, "this machine")


def _available_memory() -> int:
    """Bytes available now: /proc/meminfo's MemAvailable (the physical size elsewhere), within a
    cgroup v2 limit (``memory.max`` less ``memory.current``) when there is one."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, available)


def _cgroup_cpus() -> float | None:
    """CPUs of a cgroup v2 quota (``cpu.max``: quota period), None without one."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1.0, float(int(quota) // int(period)))


def _visible_gpus() -> int:
    """GPUs a local Ray would find: CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def joined_cluster(where: str) -> Cluster:
    """The connected Ray's resources now (it may grow: not fixed-size)."""
    import ray

    res = ray.cluster_resources()
    return Cluster(float(res.get("CPU", 0)), float(res.get("GPU", 0)), int(res.get("memory", 0)), False, where)


def model_gpus(cfg: JobConfig, cluster: Cluster) -> float:
    """GPUs per model rank as the runner resolves them: `device: auto` on a cluster without GPUs
    runs the model on the CPU (0), anything else keeps `resources.model.num_gpus`."""
    want = cfg.resources.model.num_gpus
    if want > 0 and cfg.model.device == "auto" and not cluster.gpus:
        return 0.0
    return want


def _mem(stage: StageResources) -> int:
    return int(stage.memory_gb * GIB) if stage.memory_gb else 0


def pools(cfg: JobConfig, cluster: Cluster) -> list[Pool]:
    """The actor pools of the run's graph at their minimum sizes (see the module docstring)."""
    from vlbatch.pipeline.stages.expansion import STREAMED_EXPAND

    r = cfg.resources
    scan = cfg.task.mode == "scan"
    names = ["preprocess"] if r.fuse_cpu_stages or scan else ["decode", "preprocess"]
    if not scan:
        names.append("write")
    out = [Pool(f"resources.{n}", getattr(r, n).min_actors, getattr(r, n).num_cpus,
                memory_bytes=_mem(getattr(r, n))) for n in names]
    if not scan:  # one model actor holds its whole replica (pipeline/stages/replica.py)
        n, m = cfg.model.tensor_parallel_size, r.model
        out.append(Pool("resources.model", m.min_actors, m.num_cpus * n, model_gpus(cfg, cluster) * n, _mem(m) * n))
    out.append(Pool("input (manifest read)", STREAMED_EXPAND["concurrency"], STREAMED_EXPAND["num_cpus"]))
    return out


def _user_sized(cfg: JobConfig, stage: str) -> bool:
    """Whether the config sets `resources.<stage>.num_cpus` (a default section's values are not the user's)."""
    return stage in cfg.resources.model_fields_set and "num_cpus" in getattr(cfg.resources, stage).model_fields_set


def fit_defaults(cfg: JobConfig, cluster: Cluster) -> tuple[JobConfig, dict[str, float]]:
    """`cfg` with the CPU shares of the stages the user did not size lowered (one factor for all,
    floored to 0.01 CPU) so the plan fits `cluster`'s CPUs; -> (config, {stage: new num_cpus}),
    {} when nothing changed (it fits, or nothing is the defaults' to lower)."""
    plan = pools(cfg, cluster)
    need = sum(p.cpus * p.actors for p in plan)
    if not cluster.cpus or need <= cluster.cpus + RESOURCE_UNIT:
        return cfg, {}
    ours = [p for p in plan if p.field.startswith("resources.") and not _user_sized(cfg, p.field.split(".")[1])]
    movable = sum(p.cpus * p.actors for p in ours)
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
    if sum(p.cpus * p.actors for p in pools(fitted, cluster)) > cluster.cpus + RESOURCE_UNIT:
        return cfg, {}  # even at the floor it does not fit: check_fit says why
    return fitted, sized


def fit_problems(cfg: JobConfig, cluster: Cluster) -> list[str]:
    """Each way the plan cannot run on `cluster`, one line naming the fields; [] when it fits."""
    plan = pools(cfg, cluster)
    problems = []
    on = f"{cluster.where} has"
    cpus = sum(p.cpus * p.actors for p in plan)
    if cluster.cpus and cpus > cluster.cpus + RESOURCE_UNIT:
        parts = ", ".join(f"{p.field} {p.actors}x{p.cpus:g}" for p in plan)
        problems.append(f"resources: the actor pools at min_actors and the manifest read need {cpus:.2f} CPUs but "
                        f"{on} {cluster.cpus:g} ({parts}); lower resources.*.num_cpus or min_actors")
    gpus = sum(p.gpus * p.actors for p in plan)
    m = cfg.model
    if not cluster.gpus and cfg.task.mode != "scan" and m.device == "cuda":
        problems.append(f"model.device: cuda but {on} no GPU (use model.device=auto or cpu)")
    elif gpus > cluster.gpus:
        problems.append(f"resources.model.num_gpus: the model pool needs {gpus:g} GPUs "
                        f"({m.tensor_parallel_size} rank(s) x {cfg.resources.model.num_gpus:g} x "
                        f"{cfg.resources.model.min_actors} replica(s)) but {on} {cluster.gpus:g}")
    memory = sum(p.memory_bytes * p.actors for p in plan)
    if memory > cluster.memory_bytes:
        big = ", ".join(f"{p.field}.memory_gb" for p in plan if p.memory_bytes)
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


def plan_text(cfg: JobConfig, cluster: Cluster) -> str:
    """One line: the pools, what they reserve (the figures the run's plan line prints:
    `startup.pools_text` on the same cluster) and what the cluster has, e.g.
    ``preprocess 1x0.86 CPU, write 1x0.21 CPU, model 1x0.86 CPU, input (manifest read) 1x0.05 CPU;
    reserves 1.98 CPUs, 0 GPUs of 2 CPUs, 0 GPUs, 5.1 GiB on this machine``."""
    plan = pools(cfg, cluster)
    parts = []
    for p in plan:
        what = f"{p.cpus:g} CPU" + (f" {p.gpus:g} GPU" if p.gpus else "") + \
            (f" {p.memory_bytes / GIB:g} GiB" if p.memory_bytes else "")
        parts.append(f"{p.field.removeprefix('resources.')} {p.actors}x{what}")
    cpus = sum(p.cpus * p.actors for p in plan)
    gpus = sum(p.gpus * p.actors for p in plan)
    return (f"{', '.join(parts)}; reserves {cpus:.2f} CPUs, {gpus:g} GPUs of {cluster.cpus:g} CPUs, "
            f"{cluster.gpus:g} GPUs, {cluster.memory_bytes / GIB:.1f} GiB on {cluster.where}")
