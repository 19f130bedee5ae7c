"""The prefix-sharing policy the scheduler asks (`PrefixPlanner`); storage is the prefix cache's.

The planner decides which prompt positions get a DeltaNet snapshot, which stored prefixes
queued requests expect to reuse, and which waiting sequence is held back while another one
computes a prefix they share. What is stored, matched, locked and evicted belongs to
`prefix_cache.PrefixCache`; the two meet in prefix digests (`branch_points.prefix_digest`):
the cache names each stored prefix by its digest and asks the planner's `expects(digest)`
which prefixes to evict last.

Snapshot points (`branch_points`): where the prompts of one call branch off each other
(`plan_branch_points`), plus the end of every media item (so a later call with the same media
reuses it), no two closer than `spacing` (one KV block: `spaced`). Every candidate is a
property of the prefix before it (a branch of the call's trie, a media's end), never of the
rest of the prompt, so `spaced` keeps the same points on every prompt through a shared
prefix: siblings that share [system, A] and go on to different text or a second media C all
snapshot at A's end. (Only the last media's end as a candidate broke this: [system, A,
question] kept A's end, [system, A, C, ...] the branch one token after it.)

Sibling gating (`gated`): a waiting sequence a prefix of which (beyond its cache hit) another
sequence is computing right now, to snapshot it, waits until that prefix is cached, then
starts from it. The prefix need not be one of the waiting sequence's own planned points (a
request submitted in a later call plans none there).

Expectation (`expects`): while a sequence waits (queued, or requeued after a preemption) the
prefixes at its planned points are expected; the cache evicts them after every other one (a
video's prefix is not dropped while its other questions wait for a slot).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from vlbatch.operators.engine.caches.branch_points import plan_branch_points, prefix_digest


def spaced(points, prompt_len: int, gap: int) -> tuple[int, ...]:
    """The snapshot points of one prompt: `points` ascending, below `prompt_len`, each at least
    `gap` past the one kept before it (and past 0). Each snapshot holds a whole DeltaNet state;
    one a few tokens past another (questions that share their first word, a short chat header)
    would save a few tokens of prefill. Of two close points the earlier is kept: every prompt
    that shares the later one shares it, and a media's end stays the point a later call with
    the same media and another question finds."""
    kept: list[int] = []
    for p in sorted(points):
        if p >= prompt_len:
            break
        if p - (kept[-1] if kept else 0) >= gap:
            kept.append(p)
    return tuple(kept)


class PrefixPlanner:
    """Sharing decisions for the sequences of one scheduler (see the module docstring).

    `spacing`: the least gap between two snapshot points of a prompt (the KV block size);
    `share=False` (prefix caching off) plans no points, so nothing is ever gated or expected.
    The scheduler reports each sequence's life: `queued` (added or requeued), `admitted` (with
    its cache hit), `inserted` (a planned prefix is now cached), `released` (preempted or
    finished: what it was computing is no longer in flight), `finished`.
    """

    def __init__(self, spacing: int, *, share: bool = True):
        self.spacing = spacing
        self.share = share
        self._digests: dict[int, dict[int, bytes]] = {}  # id(seq) -> {planned point: digest}
        self._probed: dict[int, dict[int, bytes]] = {}  # id(seq) -> {length: digest} asked by `gated`
        self._in_flight: dict[bytes, object] = {}  # prefix digest -> the sequence computing it
        self._flight_at: Counter[int] = Counter()  # prefix length -> in-flight digests of that length
        self._expecting: set[int] = set()  # id(seq) of waiting sequences whose digests are expected
        self._expected: Counter[bytes] = Counter()  # prefix digest -> waiting sequences expecting it

    # -- planning ----------------------------------------------------------------------------
    def branch_points(self, requests, keys: list[np.ndarray]) -> list[tuple[int, ...]]:
        """Per request of one call (keys [L] each): its snapshot points 0 < p < L, ascending."""
        if not self.share:
            return [()] * len(keys)
        return [spaced(set(bp) | {m.spans[-1][1] for m in r.media}, r.prompt_len, self.spacing)
                for r, bp in zip(requests, plan_branch_points(keys), strict=False)]

    @staticmethod
    def snapshot_points(seq, match) -> list[int]:
        """Where `seq`, starting from the cache hit `match`, snapshots and inserts: its planned
        points past the hit, and where its keys stop agreeing with the cache (`match.key_len`: a
        branch off a stored prefix that no planned point names)."""
        m = match.length
        extra = {match.key_len} if m < match.key_len < seq.prompt_len else set()
        return sorted({p for p in seq.planned if p > m} | extra)

    def expects(self, digest: bytes | None) -> bool:
        """Whether a waiting sequence plans to reuse the prefix of this digest (the cache's
        eviction preference)."""
        return self._expected[digest] > 0

    def gated(self, seq, hit: int) -> bool:
        """Whether another sequence is computing a prefix of `seq` longer than its hit (it is
        then admitted once that prefix is cached and starts from there)."""
        for p in self._flight_at:
            if hit < p < seq.prompt_len:
                owner = self._in_flight.get(self._digest(seq, p))
                if owner is not None and owner is not seq:
                    return True
        return False

    # -- a sequence's life --------------------------------------------------------------------
    def queued(self, seq) -> None:
        """`seq` waits (added, or requeued after a preemption): its planned prefixes are expected."""
        digests = self._digests.get(id(seq))
        if digests is None:
            digests = self._digests[id(seq)] = {p: prefix_digest(seq.keys, p) for p in seq.planned}
        if id(seq) not in self._expecting:
            self._expecting.add(id(seq))
            self._expected.update(digests.values())

    def admitted(self, seq, hit: int) -> None:
        """`seq` runs from a hit of `hit` tokens: it computes its planned prefixes past the hit."""
        self._unexpect(seq)  # it holds its hit now, and computes the rest itself
        for p, d in self._digests.get(id(seq), {}).items():
            if p > hit and d not in self._in_flight:
                self._in_flight[d] = seq
                self._flight_at[p] += 1

    def inserted(self, seq, p: int) -> None:
        """`seq` cached its prefix [0, p): whoever waits for it may start."""
        d = self._digests.get(id(seq), {}).get(p)
        if d is not None and self._in_flight.get(d) is seq:
            self._land(d, p)

    def released(self, seq) -> None:
        """`seq` stopped computing (preempted or finished): nothing it computed is awaited."""
        for p, d in self._digests.get(id(seq), {}).items():
            if self._in_flight.get(d) is seq:
                self._land(d, p)

    def finished(self, seq) -> None:
        self._unexpect(seq)
        self._digests.pop(id(seq), None)
        self._probed.pop(id(seq), None)

    def clear(self) -> None:
        """Forget every sequence (the scheduler dropped them all)."""
        self._digests.clear()
        self._probed.clear()
        self._in_flight.clear()
        self._flight_at.clear()

    # -- bookkeeping ---------------------------------------------------------------------------
    def _unexpect(self, seq) -> None:
        if id(seq) in self._expecting:
            self._expecting.discard(id(seq))
            digests = self._digests.get(id(seq), {}).values()
            self._expected.subtract(digests)
            for d in digests:
                if self._expected[d] <= 0:
                    del self._expected[d]

    def _digest(self, seq, p: int) -> bytes:
        d = self._digests.get(id(seq), {}).get(p)
        if d is None:
            seen = self._probed.setdefault(id(seq), {})
            d = seen.get(p)
            if d is None:
                d = seen[p] = prefix_digest(seq.keys, p)
        return d

    def _land(self, d: bytes, p: int) -> None:
        del self._in_flight[d]
        self._flight_at[p] -= 1
        if self._flight_at[p] <= 0:
            del self._flight_at[p]
