"""Pools sized from free memory (operators/engine/caches/memory.py): the arithmetic with made-up free
memory, explicit overrides, too little memory, and an engine built that way on the CPU."""
from __future__ import annotations

import pytest

from vlbatch.operators.engine.caches.memory import PREFIX_SHARE, free_memory, size_pools, state_bytes_per_seq
from vlbatch.operators.errors import ConfigError
from vlbatch.operators.factory import load_engine
from vlbatch.pipeline.config import EngineBudgets

GIB = 1 << 30


def test_size_pools_splits_the_fraction_of_free_memory():
    s = size_pools(100 * GIB, 0.9, activation_bytes=10 * GIB, max_num_seqs=64, state_bytes_per_seq=50 << 20)
    budget = int(0.9 * 90 * GIB)
    assert s.state_bytes == 64 * (50 << 20)
    assert s.prefix_cache_bytes == int(PREFIX_SHARE * (budget - s.state_bytes))
    assert s.kv_budget_bytes + s.prefix_cache_bytes + s.state_bytes == budget


def test_explicit_budgets_override_their_share():
    s = size_pools(100 * GIB, 0.5, activation_bytes=0, max_num_seqs=8, state_bytes_per_seq=1 << 20,
                   kv_budget_bytes=3 * GIB)
    assert s.kv_budget_bytes == 3 * GIB and s.prefix_cache_bytes == int(PREFIX_SHARE * (50 * GIB - (8 << 20)))
    s = size_pools(100 * GIB, 0.5, activation_bytes=0, max_num_seqs=8, state_bytes_per_seq=1 << 20,
                   prefix_cache_bytes=0)
    assert s.prefix_cache_bytes == 0 and s.kv_budget_bytes == 50 * GIB - (8 << 20)


@pytest.mark.parametrize("fraction,free", [(0.5, 1 << 20), (0.0, 100 * GIB), (1.5, 100 * GIB)])
def test_too_little_memory_or_a_bad_fraction_is_a_config_error(fraction, free):
    with pytest.raises(ConfigError):
        size_pools(free, fraction, activation_bytes=0, max_num_seqs=32, state_bytes_per_seq=1 << 20)


def test_engine_sized_from_cpu_memory(tiny_ckpt):
    ckpt = tiny_ckpt("dense")
    free = free_memory("cpu")
    assert free > 0
    fraction = (64 << 20) / free  # ~64 MiB of what is available now
    engine = load_engine(ckpt, memory_fraction=fraction, max_num_seqs=4)
    assert engine.state_bytes_per_seq == state_bytes_per_seq(engine.model.config.text, engine.model.dtype)
    kv = engine.blocks.num_blocks * engine.config.block_size * engine.kv_bytes_per_token
    total = kv + engine.config.prefix_cache_bytes + 4 * engine.state_bytes_per_seq
    assert 40 << 20 < total <= 80 << 20  # free memory moves a little between the two reads
    assert engine.config.prefix_cache_bytes > 0
    fixed = load_engine(ckpt, memory_fraction=fraction, kv_budget_bytes=1 << 20, max_num_seqs=4)
    assert fixed.config.kv_budget_bytes == 1 << 20


def test_config_passes_memory_fraction_and_only_explicit_mb_budgets():
    plain = EngineBudgets().engine_kwargs()
    assert "memory_fraction" not in plain and plain["kv_budget_bytes"] == 256 << 20
    sized = EngineBudgets(memory_fraction=0.8).engine_kwargs()
    assert sized["memory_fraction"] == 0.8 and "kv_budget_bytes" not in sized and "prefix_cache_bytes" not in sized
    pinned = EngineBudgets(memory_fraction=0.8, kv_cache_mb=512).engine_kwargs()
    assert pinned["kv_budget_bytes"] == 512 << 20 and "prefix_cache_bytes" not in pinned
