"""Prefix sharing without a model: the storage contract (`PrefixCache`) on the radix tree and on
its naive twin (a dict of exact prefixes), the radix tree's block sharing, and the planner."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vlbatch.operators.engine.caches.block_manager import BlockManager
from vlbatch.operators.engine.caches.branch_points import prefix_digest
from vlbatch.operators.engine.caches.prefix_cache import RadixPrefixCache
from vlbatch.operators.engine.caches.prefix_cache_naive import DictPrefixCache
from vlbatch.operators.engine.caches.state_pool import Snapshot
from vlbatch.operators.engine.request import Request, SamplingParams
from vlbatch.operators.engine.scheduling.prefix_planner import PrefixPlanner, spaced
from vlbatch.operators.engine.scheduling.sequence import Sequence

CACHES = pytest.mark.parametrize("cache_class", [RadixPrefixCache, DictPrefixCache], ids=["radix", "dict"])


def _snap(value: float):
    return Snapshot(torch.full((2, 3, 4), value), torch.full((2, 1, 2, 2), value))


def _computed(bm, n):
    table: list[int] = []
    bm.grow_table(table, n)
    return table


# -- the contract, on both caches ----------------------------------------------------------------
@CACHES
def test_match_at_exact_non_aligned_positions_and_shares_full_blocks(cache_class):
    bm = BlockManager(32, 4)
    pc = cache_class(bm, block_bytes=100, budget_bytes=10**9)
    keys = np.arange(100, 111)  # 11 tokens
    table = _computed(bm, 11)
    assert pc.insert(keys[:7], table, _snap(7.0))  # branch point at 7 (not a multiple of 4)
    pc.insert(keys, table, _snap(11.0))
    q = np.concatenate([keys[:9], [1, 2, 3]])
    m = pc.match(q, max_len=len(q) - 1)
    assert m.length == 7 and m.key_len == 9 and m.snapshot.conv.eq(7).all()
    assert m.blocks == tuple(table[:2])  # positions 0..6: block 0 full, block 1 partial tail
    m2 = pc.match(np.concatenate([keys, [5]]), max_len=11)
    assert m2.length == 11 and m2.blocks == tuple(table[:3])
    assert pc.match(keys, max_len=10).length == 7  # a hit must leave a token to compute
    miss = pc.match(np.array([999, 1]), 1)
    assert (miss.length, miss.key_len, miss.blocks, miss.snapshot, miss.node) == (0, 0, (), None, None)
    bm.decref(table)  # the sequence finishes; the cache keeps its blocks
    # the radix tree: block 1 straddles the branch point, held by both nodes of the path; the dict:
    # each entry holds every block of its prefix
    held = [1, 2, 1] if cache_class is RadixPrefixCache else [2, 2, 1]
    assert [bm.refcount(b) for b in table] == held
    assert pc.stats() == {"prefix_cache_bytes": 2 * _snap(7.0).nbytes + 3 * 100, "prefix_evicted_nodes": 0}


@CACHES
def test_eviction_lru_under_budget_never_touches_locked(cache_class):
    bm = BlockManager(64, 4)
    snap_bytes = _snap(0).nbytes
    pc = cache_class(bm, block_bytes=10, budget_bytes=3 * snap_bytes + 100)
    for i in range(3):
        t = _computed(bm, 4)
        pc.insert(np.array([i, 1, 2, 3]), t, _snap(i))
        bm.decref(t)
    m0 = pc.match(np.array([0, 1, 2, 3, 9]), 4)
    pc.lock(m0.node)
    pc.match(np.array([2, 1, 2, 3, 9]), 4)  # refresh 2: 1 is now least recently used
    t = _computed(bm, 4)
    pc.insert(np.array([3, 1, 2, 3]), t, _snap(3))  # over budget: one entry must go
    bm.decref(t)
    assert pc.nbytes <= pc.budget_bytes
    assert pc.match(np.array([1, 1, 2, 3, 9]), 4).length == 0  # LRU victim
    assert pc.match(np.array([0, 1, 2, 3, 9]), 4).length == 4  # locked survives
    free_before = bm.num_free
    assert pc.evict_blocks(bm.num_blocks) is False  # cannot free the locked entry's block
    assert bm.num_free == free_before + 2 and pc.match(np.array([0, 1, 2, 3, 9]), 4).length == 4
    pc.unlock(m0.node)
    pc.clear()
    assert bm.num_free == bm.num_blocks and pc.nbytes == 0


@CACHES
def test_eviction_takes_expected_prefixes_last_and_still_frees_blocks(cache_class):
    expected: set[bytes] = set()  # the planner's `expects`, by hand
    bm = BlockManager(64, 4)
    pc = cache_class(bm, block_bytes=10, budget_bytes=2 * _snap(0).nbytes + 100, keep_last=expected.__contains__)
    keys = [np.array([i, 1, 2, 3, 4, 5]) for i in range(3)]
    for i in range(2):
        t = _computed(bm, 6)
        pc.insert(keys[i][:5], t, _snap(i))  # prefix 0 is the least recently used
        bm.decref(t)
    expected.add(prefix_digest(keys[0], 5))  # a queued request plans to reuse prefix 0
    t = _computed(bm, 6)
    assert pc.insert(keys[2][:5], t, _snap(2))  # over budget: the unexpected prefix 1 goes, not the LRU one
    bm.decref(t)
    assert pc.match(keys[0], 5).length == 5 and pc.match(keys[1], 5).length == 0
    expected.clear()
    pc.match(keys[0], 5)  # prefix 0 is now the most recently used: plain LRU takes prefix 2
    pc.budget_bytes = _snap(0).nbytes + 100
    pc.evict_to_budget()
    assert pc.match(keys[0], 5).length == 5 and pc.match(keys[2], 5).length == 0
    expected.add(prefix_digest(keys[0], 5))
    assert pc.evict_blocks(bm.num_blocks) is True and pc.nbytes == 0  # KV memory still comes first


def test_the_dict_twin_matches_as_the_radix_tree_does():
    """Random inserts of prefixes that share and branch, then random lookups: both caches find
    the same hit, the same agreement length and the same snapshot."""
    rng = random.Random(1)
    for _ in range(40):
        bms = [BlockManager(4096, 4), BlockManager(4096, 4)]
        caches = [RadixPrefixCache(bms[0], 10, 10**9), DictPrefixCache(bms[1], 10, 10**9)]
        words = [np.array([rng.randint(0, 2) for _ in range(rng.randint(2, 14))]) for _ in range(6)]
        for _ in range(8):
            w = words[rng.randrange(len(words))]
            p = rng.randint(1, len(w))
            snap = _snap(float(p))
            for bm, pc in zip(bms, caches, strict=True):
                pc.insert(w[:p], _computed(bm, p), snap)
        for _ in range(20):
            q = words[rng.randrange(len(words))][: rng.randint(1, 14)]
            max_len = rng.randint(0, len(q))
            radix, naive = (pc.match(q, max_len) for pc in caches)
            assert (radix.length, radix.key_len, radix.snapshot) == (naive.length, naive.key_len, naive.snapshot)


# -- the radix tree's block sharing ----------------------------------------------------------------
def test_split_keeps_straddling_block_for_both_halves():
    bm = BlockManager(32, 4)
    pc = RadixPrefixCache(bm, block_bytes=100, budget_bytes=10**9)
    a = np.arange(10)
    ta = _computed(bm, 10)
    pc.insert(a, ta, _snap(1.0))
    b = np.concatenate([a[:6], [50, 51, 52, 53]])
    tb = list(ta[:1]) + _computed(bm, 8)[:2]  # b computed its own block 1 (copy) and block 2
    pc.insert(b[:6], tb, _snap(2.0))  # split a's node at 6 (mid block 1)
    assert bm.refcount(ta[1]) == 3  # a's sequence + both halves of the split node
    pc.insert(b, tb, _snap(3.0))
    mb = pc.match(np.concatenate([b, [0]]), 10)
    ma = pc.match(np.concatenate([a, [0]]), 10)
    assert mb.blocks == (ta[0], tb[1], tb[2]) and ma.blocks == tuple(ta[:3])
    assert pc.match(np.concatenate([a[:6], [77]]), 6).snapshot.conv.eq(2).all()


# -- the planner -----------------------------------------------------------------------------------
def test_snapshot_points_are_spaced_by_a_block_keeping_the_earlier():
    # a 13-token header, the media end at 461, all siblings branch at 463, pairs at 465 / 466
    assert spaced({13, 461, 463, 465, 466}, 486, 16) == (461,)
    assert spaced({40, 60, 100}, 120, 16) == (40, 60, 100)  # far enough apart: all kept
    assert spaced({16, 31, 32, 47, 48}, 120, 16) == (16, 32, 48)  # measured from the last kept one
    assert spaced({20, 40}, 40, 16) == (20,)  # never at the prompt's end
    assert spaced(set(), 10, 16) == ()


def _seq(rid, ids, planned=()):
    pos = torch.arange(len(ids)).expand(3, -1).contiguous()
    req = Request(id=rid, prompt_token_ids=tuple(ids), position_ids=pos, sampling=SamplingParams(max_new_tokens=2))
    return Sequence(req, np.asarray(ids, dtype=np.int64), tuple(planned), None)


def test_planner_expects_what_waiting_sequences_plan_and_gates_siblings():
    planner = PrefixPlanner(4)
    shared = list(range(1, 12))
    a, b = _seq("a", shared + [50, 51], (11,)), _seq("b", shared + [60], (11,))
    d = prefix_digest(a.keys, 11)
    planner.queued(a)
    planner.queued(b)
    assert planner.expects(d) and not planner.gated(b, 0)  # nobody computes the prefix yet
    planner.admitted(a, 0)  # a computes [0, 11): b waits for it, and still expects it
    assert planner.gated(b, 0) and not planner.gated(a, 0) and planner.expects(d)
    assert not planner.gated(b, 11)  # a hit that covers the prefix: nothing to wait for
    planner.inserted(a, 11)
    assert not planner.gated(b, 0)
    planner.admitted(b, 11)
    assert not planner.expects(d)  # nobody waits for it any more
    planner.released(b)
    planner.queued(b)  # preempted: it waits, and expects its prefix, again
    assert planner.expects(d)
    planner.finished(b)
    assert not planner.expects(d)


def test_planner_released_sequence_no_longer_gates_and_off_plans_nothing():
    planner = PrefixPlanner(4)
    shared = list(range(1, 12))
    a, b = _seq("a", shared + [50, 51], (11,)), _seq("b", shared + [60], (11,))
    for s in (a, b):
        planner.queued(s)
    planner.admitted(a, 0)
    planner.released(a)  # preempted before it cached the prefix: b must not wait forever
    assert not planner.gated(b, 0)
    keys = [a.keys, b.keys]
    reqs = [a.request, b.request]
    assert PrefixPlanner(4).branch_points(reqs, keys) == [(11,), (11,)]
    assert PrefixPlanner(4, share=False).branch_points(reqs, keys) == [(), ()]
