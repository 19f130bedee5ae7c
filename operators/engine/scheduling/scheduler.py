"""Continuous batching: which sequences run which tokens in the next step.

Each step packs, under `max_num_batched_tokens` and `max_num_seqs`:
1. every running sequence, in admission order: one token if decoding, else its next
   prefill chunk (at most `chunk_size`, and cut at its next branch point so the DeltaNet
   states can be snapshotted at that exact position);
2. then waiting sequences, first come first served, each starting from its prefix-cache
   hit, unless the planner holds it back (`PrefixPlanner.gated`: another sequence is
   computing a longer prefix of it right now; sibling groups compute a shared prefix once).

Prefix sharing is split in two, and the scheduler asks both: the planner
(`prefix_planner.PrefixPlanner`: where a sequence snapshots, which waiting sequence is
gated, which prefixes waiting ones expect) and the cache (`prefix_cache.PrefixCache`:
match, insert, lock, evict). The scheduler tells the planner each sequence's life
(queued, admitted, inserted, released, finished).

KV blocks are allocated chunk by chunk. When none are free, unlocked prefix-cache leaves
are evicted first, then the most recently admitted running sequence is preempted
(released and requeued in front; it recomputes later, from whatever prefix is cached),
so running out of KV memory never crashes. A request whose prompt plus max_new_tokens
cannot fit in the whole pool is rejected with an error result up front.

The scheduler always has a planner and a prefix cache; with caching off they are a planner
that plans no points (`share=False`) and `NoPrefixCache`, whose empty plans, misses and
no-op inserts make every step above the plain path (no cuts, no gating, no snapshots).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vlbatch.operators.engine.caches.block_manager import BlockManager
from vlbatch.operators.engine.caches.prefix_cache import Match, PrefixCache
from vlbatch.operators.engine.caches.state_pool import StatePool
from vlbatch.operators.engine.scheduling.prefix_planner import PrefixPlanner
from vlbatch.operators.engine.scheduling.sequence import Sequence, Status


@dataclass(frozen=True)
class Chunk:
    """Sequence `seq` computes positions [start, end); `sample` when end is its last token."""

    seq: Sequence
    start: int
    end: int

    @property
    def sample(self) -> bool:
        return self.end == len(self.seq.token_ids)  # (asked per chunk and step: no property chain)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src block, dst block, tokens)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_hits: int = 0
    snapshots_inserted: int = 0


class Scheduler:
    def __init__(self, blocks: BlockManager, states: StatePool, cache: PrefixCache, planner: PrefixPlanner, *,
                 max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int | None):
        self.bm, self.pool, self.cache, self.planner = blocks, states, cache, planner
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self.failed: list[tuple[Sequence, str]] = []  # finished with an error; the engine reports them

    # -- queue -----------------------------------------------------------------------------
    def fits_at_all(self, seq: Sequence) -> bool:
        need = seq.prompt_len + seq.request.sampling.max_new_tokens
        return self.bm.blocks_needed(need) <= self.bm.num_blocks

    def add(self, seq: Sequence) -> None:
        self.planner.queued(seq)
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning a step -------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget, bs = self.max_tokens, self.bm.block_size
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            done = seq.num_computed
            if done + 1 == len(seq.token_ids) and not seq.branches and done < len(seq.block_table) * bs:
                # the common step: one token into a block the sequence holds (what `_chunk_len`
                # and `_grow` below decide for it, without asking them)
                plan.chunks.append(Chunk(seq, done, done + 1))
                budget -= 1
                continue
            n = self._chunk_len(seq, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    self.finish(seq)
                    self.failed.append((seq, f"request {seq.id!r} does not fit in the KV pool even alone"))
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                plan.chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + n))
                budget -= n
        self._admit(plan, budget)
        return plan

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        n = min(seq.remaining, self.chunk_size, budget)
        nb = seq.next_branch()
        if nb is not None:
            n = min(n, nb - seq.num_computed)
        return n

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.bm.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.bm.num_free:
            self.cache.evict_blocks(need)
        if need > self.bm.num_free:
            return False
        self.bm.grow_table(seq.block_table, num_tokens)
        return True

    def _match(self, seq: Sequence) -> Match:
        return self.cache.match(seq.keys, min(seq.prompt_len, seq.num_tokens - 1))

    def _admit(self, plan: StepPlan, budget: int) -> None:
        i = 0
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs
               and self.pool.num_free > 0):
            seq = self.waiting[i]
            match = self._match(seq)
            if self.planner.gated(seq, match.length):
                i += 1
                continue
            if not self._start(seq, match, plan, budget):
                return  # out of KV blocks: wait for running sequences to finish
            del self.waiting[i]
            budget -= plan.chunks[-1].length

    def _start(self, seq: Sequence, match: Match, plan: StepPlan, budget: int) -> bool:
        bs, m = self.bm.block_size, match.length
        self.cache.lock(match.node)
        full = list(match.blocks[: m // bs])
        self.bm.incref(full)
        seq.block_table, seq.num_computed = full, m
        seq.branches = self.planner.snapshot_points(seq, match)
        n = self._chunk_len(seq, budget)
        # admit only when the whole rest of the prompt (+1 token) fits now: chunk-by-chunk
        # allocation then rarely has to preempt a sequence that was just admitted
        whole = self.bm.blocks_needed(seq.num_tokens + 1) - len(full)
        if whole > self.bm.num_free:
            self.cache.evict_blocks(whole)
        if whole > self.bm.num_free or not self._grow(seq, m + n):
            self.bm.decref(full)
            self.cache.unlock(match.node)
            seq.block_table, seq.num_computed, seq.branches = [], 0, []
            return False
        if m % bs:  # copy-on-write of the partially shared tail block
            plan.copies.append((match.blocks[m // bs], seq.block_table[m // bs], m % bs))
        seq.slot = self.pool.allocate()
        if match.snapshot is not None:
            self.pool.restore(seq.slot, match.snapshot)
        seq.node, seq.cached_tokens = match.node, m
        seq.status = Status.RUNNING
        seq.t_admitted = seq.t_admitted or time.perf_counter()
        if m:
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += m
        self.planner.admitted(seq, m)
        self.running.append(seq)
        plan.chunks.append(Chunk(seq, m, m + n))
        return True

    # -- after a step ----------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """Advance every chunk; snapshot + insert into the prefix cache at branch points."""
        for c in plan.chunks:
            seq = c.seq
            seq.num_computed = c.end
            if seq.node is not None:
                self.cache.unlock(seq.node)  # snapshot restored, tail block copied: hit no longer needed
                seq.node = None
            if c.end >= seq.prompt_len:
                continue
            if seq.branches and seq.branches[0] == c.end:
                stored = self.cache.insert(seq.keys[: c.end], seq.block_table, self.pool.snapshot(seq.slot))
                self.stats.snapshots_inserted += stored
                self.planner.inserted(seq, c.end)

    def _release(self, seq: Sequence) -> None:
        self.bm.decref(seq.block_table)
        seq.block_table = []
        if seq.slot is not None:
            self.pool.free(seq.slot)
            seq.slot = None
        self.cache.unlock(seq.node)
        seq.node = None
        seq.features.clear()
        self.planner.released(seq)
        if seq in self.running:
            self.running.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed, seq.branches = 0, []
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.planner.queued(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self._release(seq)
        self.planner.finished(seq)
        seq.status = Status.FINISHED

    def abort_all(self) -> None:
        """Release everything (the caller stopped consuming results)."""
        for seq in list(self.running):
            self.finish(seq)
        for seq in self.waiting:
            self.planner.finished(seq)
            seq.status = Status.FINISHED
        self.waiting.clear()
        self.planner.clear()
