"""Scheduler decisions without a model: chunking, branch-point cuts, sibling gating, preemption."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbatch.operators.engine.caches.block_manager import BlockManager
from vlbatch.operators.engine.caches.branch_points import plan_branch_points
from vlbatch.operators.engine.caches.prefix_cache import NoPrefixCache, RadixPrefixCache
from vlbatch.operators.engine.caches.prefix_cache_naive import DictPrefixCache
from vlbatch.operators.engine.caches.state_pool import StatePool
from vlbatch.operators.engine.request import Request, SamplingParams
from vlbatch.operators.engine.scheduling.prefix_planner import PrefixPlanner
from vlbatch.operators.engine.scheduling.scheduler import Scheduler
from vlbatch.operators.engine.scheduling.sequence import Sequence, Status


def _req(rid, ids, new=4):
    pos = torch.arange(len(ids)).expand(3, -1).contiguous()
    return Request(id=rid, prompt_token_ids=tuple(ids), position_ids=pos, sampling=SamplingParams(max_new_tokens=new))


def _setup(reqs, blocks=64, bs=4, seqs=8, tokens=64, chunk=None, cache=RadixPrefixCache):
    """A scheduler over `cache` (a storing cache class, or None: caching off); plans are the
    raw branch points (no spacing, no media)."""
    bm = BlockManager(blocks, bs)
    pool = StatePool(seqs, 1, 2, 2, 1, 1, 1)
    planner = PrefixPlanner(bs, share=cache is not None)
    pc = cache(bm, 100, 10**9, planner.expects) if cache else NoPrefixCache()
    sched = Scheduler(bm, pool, pc, planner, max_num_seqs=seqs, max_num_batched_tokens=tokens, chunk_size=chunk)
    keys = [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in reqs]
    plans = plan_branch_points(keys) if cache else [()] * len(reqs)
    seqs_ = [Sequence(r, k, p, None) for r, k, p in zip(reqs, keys, plans, strict=False)]
    for s in seqs_:
        sched.add(s)
    return sched, seqs_


def _step(sched, sampled_token=7):
    plan = sched.schedule()
    sched.commit(plan)
    for c in plan.chunks:
        if c.sample:
            c.seq.token_ids.append(sampled_token)
            if len(c.seq.output_ids) >= c.seq.request.sampling.max_new_tokens:
                sched.finish(c.seq)
    return [(c.seq.id, c.start, c.end) for c in plan.chunks]


@pytest.mark.parametrize("cache", [RadixPrefixCache, DictPrefixCache], ids=["radix", "dict"])
def test_siblings_wait_for_the_shared_prefix_then_hit_it(cache):
    shared = list(range(1, 12))  # 11 shared tokens: branch point 11, not block aligned
    a, b, c = (_req(n, shared + tail) for n, tail in (("a", [50, 51, 52]), ("b", [60, 61]), ("c", [70])))
    sched, seqs = _setup([a, b, c], cache=cache)
    assert seqs[0].planned == (11,)
    assert _step(sched) == [("a", 0, 11)]  # cut at the branch point; b and c held back
    assert _step(sched) == [("a", 11, 14), ("b", 11, 13), ("c", 11, 12)]
    assert [s.cached_tokens for s in seqs] == [0, 11, 11]
    assert sched.stats.prefix_hit_tokens == 22 and sched.stats.snapshots_inserted == 1


def test_token_budget_chunk_size_and_decode_batching():
    reqs = [_req("long", list(range(1, 30))), _req("short", [5, 6, 7])]
    sched, _ = _setup(reqs, tokens=10, chunk=8, cache=None)
    assert _step(sched) == [("long", 0, 8), ("short", 0, 2)]  # chunk limit, then what the budget leaves
    assert _step(sched) == [("long", 8, 16), ("short", 2, 3)]
    assert _step(sched) == [("long", 16, 24), ("short", 3, 4)]  # short decodes beside the prefill


def test_decodes_take_a_block_exactly_when_they_start_one():
    """A decode step plans one token per sequence, and a table grows by one block exactly when its
    token is the first of a block (the common step skips `_grow`: the two must agree)."""
    reqs = [_req("a", [1, 2, 3], new=12), _req("b", [4, 5, 6, 7, 8], new=12)]
    sched, seqs = _setup(reqs, bs=4, cache=None)
    _step(sched)  # the prompts
    for _ in range(10):
        free = sched.bm.num_free
        planned = _step(sched)
        assert [e - s for _, s, e in planned] == [1, 1]
        assert free - sched.bm.num_free == sum(s % 4 == 0 for _, s, _ in planned)
        assert [len(q.block_table) for q in seqs] == [-(-q.num_computed // 4) for q in seqs]


def test_preemption_requeues_latest_and_recomputes():
    reqs = [_req(f"r{i}", [10 * i + j for j in range(1, 8)], new=6) for i in range(3)]
    sched, seqs = _setup(reqs, blocks=7, bs=4, cache=None)  # 28 tokens for 3 x (7 + 6)
    finished, steps = [], 0
    while sched.has_work and steps < 100:
        _step(sched)
        finished += [s.id for s in seqs if s.status is Status.FINISHED and s.id not in finished]
        assert sched.bm.num_free >= 0
        steps += 1
    assert sorted(finished) == ["r0", "r1", "r2"] and sched.stats.preemptions > 0
    assert all(len(s.output_ids) == 6 for s in seqs)
    assert sched.bm.num_free == 7 and sched.pool.num_free == 8  # everything released


def test_request_that_never_fits_is_flagged():
    sched, seqs = _setup([_req("big", list(range(1, 40)), new=4)], blocks=4, bs=4, cache=None)
    assert not sched.fits_at_all(seqs[0])


def test_no_prefix_cache_is_the_plain_path():
    """Caching off: no plans, no gating of siblings, no snapshots, no block references kept."""
    shared = list(range(1, 12))
    reqs = [_req(n, shared + tail) for n, tail in (("a", [50, 51, 52]), ("b", [60, 61]))]
    sched, seqs = _setup(reqs, cache=None)
    cache = sched.cache
    assert sched.planner.branch_points(reqs, [s.keys for s in seqs]) == [(), ()]
    assert _step(sched) == [("a", 0, 14), ("b", 0, 13)]  # both admitted at once, uncut
    assert sched.stats.snapshots_inserted == 0 and sched.stats.prefix_hits == 0
    table = list(seqs[0].block_table)
    refs = [sched.bm.refcount(b) for b in table]
    assert cache.insert(seqs[0].keys, table, None) is False
    assert [sched.bm.refcount(b) for b in table] == refs  # nothing held by the cache
    assert cache.match(seqs[0].keys, 13).length == 0 and cache.evict_blocks(1) is False
    assert cache.stats() == {"prefix_cache_bytes": 0, "prefix_evicted_nodes": 0}
