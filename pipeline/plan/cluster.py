"""The cluster a run's actors reserve on: `Cluster`, found before the graph starts.

    cluster = local_cluster()            # a new local Ray: what it would register, no process started
    cluster = joined_cluster(address)    # a Ray joined by --address / ray.address (connected first)

A local Ray (`fixed_size`) never grows; a joined cluster may add nodes (autoscaling). The pools set
against it are the plan's (`plan/spec.py`), the fit checks `plan/fit.py`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    """The resources a run's actors may reserve. `fixed_size`: a local Ray started for the run
    (never grows); `where`: how lines name it; `may_add_gpus`: whether an autoscaler can add a GPU
    node (True: its node types include GPUs; False: no autoscaler, or none of its types has a GPU;
    None: an autoscaler whose node types Ray does not publish, `gpu_growth`)."""

    cpus: float
    gpus: float
    memory_bytes: int
    fixed_size: bool
    where: str
    may_add_gpus: bool | None = False


OBJECT_STORE_SHARE = 0.3  # a local Ray's object store takes this share of the available memory ...
OBJECT_STORE_MAX = 200 * GIB  # ... up to this (Ray's defaults); its `memory` resource is the rest


def local_cluster() -> Cluster:
    """What a new local Ray on this machine registers, computed as Ray does it without starting a
    process (and without Ray's private API): the machine's CPUs (within a cgroup quota), the GPUs
    CUDA_VISIBLE_DEVICES or nvidia-smi lists, and the `memory` resource (the available memory less the
    object store)."""
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


_AUTOSCALING_STATUS_KEY = "__autoscaling_status"  # ray_constants.DEBUG_AUTOSCALING_STATUS


def joined_cluster(where: str) -> Cluster:
    """The connected Ray's resources now (it may grow: not fixed-size), and whether its autoscaler
    can add GPU nodes (`gpu_growth` of what the cluster publishes)."""
    import ray

    res = ray.cluster_resources()
    return Cluster(float(res.get("CPU", 0)), float(res.get("GPU", 0)), int(res.get("memory", 0)), False, where,
                   gpu_growth(*_autoscaler_facts()))


def gpu_growth(max_resources: dict | None, autoscaler_status: bytes | None) -> bool | None:
    """Whether an autoscaler can add GPU nodes: from the cluster config's node types (`max_resources`:
    {resource: most the node types can add}, published by autoscaler v2 and KubeRay's; Ray Data reads
    the same) when there is one; else the head's monitor status (JSON; every head writes one, an
    autoscaler adds its `autoscaler_report`, v1 without its node types): an autoscaler there is None,
    unknown; none, the read-only provider of a plain head (`_read_only`), or no status is False. A status we
    cannot read is None: never refused on a doubt."""
    if max_resources is not None:
        return float(max_resources.get("GPU", 0) or 0) > 0
    if not autoscaler_status:
        return False
    try:
        status = json.loads(autoscaler_status)
    except ValueError:
        return None
    if not isinstance(status, dict):
        return None
    report = status.get("autoscaler_report")
    return False if report is None or _read_only(report) else None


def _read_only(report) -> bool:
    """Whether an `autoscaler_report` is the read-only provider's, which a plain `ray start --head` monitor
    runs (it launches nothing): each node's type is Ray's anonymous `node_<node id>`, and no launch pending."""
    if not isinstance(report, dict):
        return False
    mapping = report.get("node_type_mapping")
    return (isinstance(mapping, dict) and bool(mapping) and not report.get("pending_launches")
            and all(v == f"node_{k}" for k, v in mapping.items()))


def _autoscaler_facts() -> tuple[dict | None, bytes | None]:
    """(the cluster config's max resources, the autoscaler's status) of the connected Ray. Ray has no
    public API for the cluster config's node types, so only the status the head's monitor keeps in the
    GCS key-value store (what `ray status` prints; the key is Ray's DEBUG_AUTOSCALING_STATUS) is read;
    any failure there reads as "unknown", never as "no autoscaler"."""
    try:
        from ray.experimental import internal_kv

        return None, internal_kv._internal_kv_get(_AUTOSCALING_STATUS_KEY)
    except Exception:  # noqa: BLE001 - a Ray without this key-value API: the autoscaler unknown
        return None, b"unknown"
