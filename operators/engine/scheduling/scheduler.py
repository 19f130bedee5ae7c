"""Continuous batching: which sequences run which tokens in the next step.

Each step packs, under `max_num_batched_tokens` and `max_num_seqs`:
1. every running sequence, in admission order: one token if decoding, else its next
   prefill chunk (at most `chunk_size`, and cut at its next branch point so the DeltaNet
   states can be snapshotted at that exact position);
2. then waiting sequences, first come first served, each starting from its prefix-cache
   hit. A waiting sequence a prefix of which (beyond its hit) another sequence is computing
   right now, to snapshot it, is skipped until that prefix is cached (sibling groups: the
   shared prefix is computed once; it need not be one of the waiting sequence's own planned
   points, e.g. a request submitted in a later call). While a sequence waits, the prefixes it plans to reuse
   are `expect`ed in the prefix cache, which then evicts them last.

KV blocks are allocated chunk by chunk. When none are free, unlocked prefix-cache leaves
are evicted first, then the most recently admitted running sequence is preempted
(released and requeued in front; it recomputes later, from whatever prefix is cached),
so running out of KV memory never crashes. A request whose prompt plus max_new_tokens
cannot fit in the whole pool is rejected with an error result up front.

The scheduler always has a prefix cache (`prefix_cache.PrefixCache`); with caching off it
is `NoPrefixCache`, whose misses, empty plans and no-op inserts make every step above
the plain path (no cuts, no gating, no snapshots).
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from vlbatch.operators.engine.caches.block_manager import BlockManager
from vlbatch.operators.engine.caches.branch_points import prefix_digest
from vlbatch.operators.engine.caches.prefix_cache import Match, PrefixCache
from vlbatch.operators.engine.caches.state_pool import StatePool
from vlbatch.operators.engine.scheduling.sequence import Sequence, Status


@dataclass(frozen=True)
class Chunk:
    """Sequence `seq` computes positions [start, end); `sample` when end is its last token."""

    seq: Sequence
    start: int
    end: int

    @property
    def sample(self) -> bool:
        return self.end == self.seq.num_tokens

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
    def __init__(self, blocks: BlockManager, states: StatePool, cache: PrefixCache, *,
                 max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int | None):
        self.bm, self.pool, self.cache = blocks, states, cache
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._in_flight: dict[bytes, Sequence] = {}  # prefix digest -> the sequence computing it
        self._flight_at: Counter[int] = Counter()  # prefix length -> in-flight digests of that length
        self._probed: dict[int, dict[int, bytes]] = {}  # id(seq) -> {length: digest} asked by `_gated`
        self._digests: dict[int, dict[int, bytes]] = {}  # id(seq) -> {branch point: digest}
        self._expecting: set[int] = set()  # id(seq) of waiting sequences whose digests the cache expects
        self.stats = SchedulerStats()
        self.failed: list[tuple[Sequence, str]] = []  # finished with an error; the engine reports them

    # -- queue -----------------------------------------------------------------------------
    def fits_at_all(self, seq: Sequence) -> bool:
        need = seq.prompt_len + seq.request.sampling.max_new_tokens
        return self.bm.blocks_needed(need) <= self.bm.num_blocks

    def add(self, seq: Sequence) -> None:
        self._digests[id(seq)] = {p: prefix_digest(seq.keys, p) for p in seq.planned}
        self._expect(seq)
        self.waiting.append(seq)

    def _expect(self, seq: Sequence) -> None:
        if id(seq) not in self._expecting:
            self._expecting.add(id(seq))
            self.cache.expect(self._digests.get(id(seq), {}).values())

    def _unexpect(self, seq: Sequence) -> None:
        if id(seq) in self._expecting:
            self._expecting.discard(id(seq))
            self.cache.unexpect(self._digests.get(id(seq), {}).values())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning a step -------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget <= 0:
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

    def _gated(self, seq: Sequence, hit: int) -> bool:
        """Whether another sequence is computing a prefix of `seq` longer than its hit (it is
        then admitted once that prefix is cached and starts from there)."""
        for p in self._flight_at:
            if hit < p < seq.prompt_len:
                owner = self._in_flight.get(self._digest(seq, p))
                if owner is not None and owner is not seq:
                    return True
        return False

    def _digest(self, seq: Sequence, p: int) -> bytes:
        d = self._digests.get(id(seq), {}).get(p)
        if d is None:
            seen = self._probed.setdefault(id(seq), {})
            d = seen.get(p)
            if d is None:
                d = seen[p] = prefix_digest(seq.keys, p)
        return d

    def _fly(self, d: bytes, p: int, seq: Sequence) -> None:
        if d not in self._in_flight:
            self._in_flight[d] = seq
            self._flight_at[p] += 1

    def _land(self, d: bytes, p: int) -> None:
        del self._in_flight[d]
        self._flight_at[p] -= 1
        if self._flight_at[p] <= 0:
            del self._flight_at[p]

    def _admit(self, plan: StepPlan, budget: int) -> None:
        i = 0
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs
               and self.pool.num_free > 0):
            seq = self.waiting[i]
            match = self._match(seq)
            if self._gated(seq, match.length):
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
        seq.branches = sorted({p for p in seq.planned if p > m}
                              | ({match.key_len} if m < match.key_len < seq.prompt_len else set()))
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
        self._unexpect(seq)  # it holds its hit now, and computes the rest itself
        seq.t_admitted = seq.t_admitted or time.perf_counter()
        if m:
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += m
        for p, d in self._digests.get(id(seq), {}).items():
            if p > m:
                self._fly(d, p, seq)
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
                node = self.cache.insert(seq.keys[: c.end], seq.block_table, self.pool.snapshot(seq.slot))
                self.stats.snapshots_inserted += node is not None and node.snapshot is not None
                d = self._digests.get(id(seq), {}).get(c.end)
                if d is not None and self._in_flight.get(d) is seq:
                    self._land(d, c.end)

    def _release(self, seq: Sequence) -> None:
        self.bm.decref(seq.block_table)
        seq.block_table = []
        if seq.slot is not None:
            self.pool.free(seq.slot)
            seq.slot = None
        self.cache.unlock(seq.node)
        seq.node = None
        seq.features.clear()
        for p, d in self._digests.get(id(seq), {}).items():
            if self._in_flight.get(d) is seq:
                self._land(d, p)
        if seq in self.running:
            self.running.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed, seq.branches = 0, []
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._expect(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self._release(seq)
        self._unexpect(seq)
        seq.status = Status.FINISHED
        self._digests.pop(id(seq), None)
        self._probed.pop(id(seq), None)

    def abort_all(self) -> None:
        """Release everything (the caller stopped consuming results)."""
        for seq in list(self.running):
            self.finish(seq)
        for seq in self.waiting:
            self._unexpect(seq)
            seq.status = Status.FINISHED
        self.waiting.clear()
        self._digests.clear()
        self._probed.clear()
        self._in_flight.clear()
        self._flight_at.clear()
