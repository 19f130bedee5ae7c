"""Pools sized from the device: `memory_fraction` of the memory free after loading the
weights and a profiling step goes to the KV blocks, the DeltaNet slots and the prefix cache.

`free_memory(device)`: on CUDA `torch.cuda.mem_get_info` (what the driver can still hand
out), on the CPU the system's available memory (`MemAvailable` of /proc/meminfo).
`profile_step` runs one prefill of `max_num_batched_tokens` text tokens and returns its
activation peak (CUDA; 0 elsewhere, where the allocator keeps no peak). `size_pools` is
the arithmetic, a pure function (tested with made-up free memory):

    budget  = fraction * (free - activation peak)
    slots   = max_num_seqs * state_bytes_per_seq             (always that many slots)
    prefix  = prefix_share * (budget - slots)   unless given  (snapshots + the KV it pins)
    kv      = budget - slots - prefix           unless given

Explicit byte budgets override their share. Vision features are not profiled: the vision
cache keeps its own budget.

Over a tensor-parallel replica (`comm` of N ranks) every rank calls `budgets_from_memory`
(the profiling step is a sharded forward: its collectives need all ranks) and the sizes
come from the tightest rank (least free memory, largest peak), so all ranks compute the
same budgets. On the CPU the ranks share one host's memory (one node), so each takes 1/N
of what is free.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlbatch.operators.engine.config import EngineConfig
from vlbatch.operators.errors import ConfigError

PREFIX_SHARE = 0.125  # of what the slots leave, when the prefix cache budget is not given


@dataclass(frozen=True)
class PoolSizes:
    kv_budget_bytes: int
    prefix_cache_bytes: int
    state_bytes: int  # the DeltaNet slots' share (max_num_seqs of them)


def size_pools(free_bytes: int, fraction: float, *, activation_bytes: int, max_num_seqs: int,
               state_bytes_per_seq: int, kv_budget_bytes: int | None = None,
               prefix_cache_bytes: int | None = None) -> PoolSizes:
    """The byte budgets of the pools (see the module docstring)."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"memory_fraction must be in (0, 1], got {fraction}")
    budget = int(fraction * max(free_bytes - activation_bytes, 0))
    slots = max_num_seqs * state_bytes_per_seq
    rest = budget - slots
    prefix = prefix_cache_bytes if prefix_cache_bytes is not None else max(int(PREFIX_SHARE * rest), 0)
    kv = kv_budget_bytes if kv_budget_bytes is not None else rest - prefix
    if kv <= 0:
        raise ConfigError(f"memory_fraction={fraction} of {free_bytes >> 20} MiB free leaves no KV pool "
                          f"({slots >> 20} MiB go to {max_num_seqs} DeltaNet slots, {prefix >> 20} MiB to the "
                          f"prefix cache, {activation_bytes >> 20} MiB to activations)")
    return PoolSizes(kv, prefix, slots)


def free_memory(device) -> int:
    """Bytes still free on `device` (CUDA: the driver's figure; CPU: MemAvailable)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    raise ConfigError("memory_fraction on the CPU needs /proc/meminfo (MemAvailable)")


def profile_step(model, num_tokens: int) -> int:
    """Activation peak (bytes) of one prefill of `num_tokens` text tokens (CUDA; else 0)."""
    if model.device.type != "cuda":
        return 0
    torch.cuda.synchronize(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    before = torch.cuda.memory_allocated(model.device)
    ids = torch.zeros(1, num_tokens, dtype=torch.long, device=model.device)
    model(ids, logits_to_keep=1)
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - before
    torch.cuda.empty_cache()
    return peak


def state_bytes_per_seq(text, dtype: torch.dtype) -> int:
    """One sequence's DeltaNet states over all linear layers: conv (model dtype) + recurrent (float32)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    conv = text.linear_conv_dim * text.linear_conv_kernel_dim * elem
    rec = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    return len(text.linear_layers) * (conv + rec)


def budgets_from_memory(model, fraction: float, budgets: dict, comm=None) -> dict:
    """`budgets` (EngineConfig fields) with the KV pool and prefix cache sized from free memory
    after a profiling step; budgets given explicitly are kept. `comm`: the replica's ranks,
    all calling this with the same arguments (see the module docstring)."""
    defaults = EngineConfig(**{k: v for k, v in budgets.items() if k not in ("kv_budget_bytes", "prefix_cache_bytes")})
    activation = profile_step(model, defaults.max_num_batched_tokens)
    free = free_memory(model.device)
    if comm is not None and comm.world > 1:
        free, activation = tightest_rank(comm, free, activation, model.device)
    sizes = size_pools(free, fraction, activation_bytes=activation,
                       max_num_seqs=defaults.max_num_seqs,
                       state_bytes_per_seq=state_bytes_per_seq(model.config.text, model.dtype),
                       kv_budget_bytes=budgets.get("kv_budget_bytes"),
                       prefix_cache_bytes=budgets.get("prefix_cache_bytes"))
    return {**budgets, "kv_budget_bytes": sizes.kv_budget_bytes, "prefix_cache_bytes": sizes.prefix_cache_bytes}


def tightest_rank(comm, free: int, activation: int, device) -> tuple[int, int]:
    """(least free bytes, largest activation peak) over the ranks; the free bytes of CPU
    ranks (one host) split N ways."""
    mine = torch.tensor([[free, activation]], dtype=torch.int64, device=device)
    every = comm.all_gather(mine, 0)  # [world, 2]
    least = int(every[:, 0].min())
    if torch.device(device).type != "cuda":
        least //= comm.world
    return least, int(every[:, 1].max())
