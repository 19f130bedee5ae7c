"""`DictPrefixCache`: the radix tree's naive twin, a dict of exact prefixes.

It keeps the `prefix_cache.PrefixCache` contract with the plainest storage: one entry per
inserted prefix, keyed by the tuple of its keys, holding its own references on every KV
block of positions [0, len) (no sharing of structure between entries, so no splits and no
straddling blocks), and `match` scans every entry for the longest stored prefix of the keys.
O(entries x length) per call: a reference for the tests (the engine tests run against both
caches), never for production.
"""
from __future__ import annotations

import numpy as np

from vlbatch.operators.engine.caches.branch_points import common_prefix_len, prefix_digest
from vlbatch.operators.engine.caches.prefix_cache import BudgetedPrefixCache, Match, Node
from vlbatch.operators.engine.caches.state_pool import Snapshot


class DictPrefixCache(BudgetedPrefixCache):
    """Entries are `Node`s with `start` 0 and no parent: `key` is the whole prefix, `blocks`
    the blocks of block indices 0 .. ceil(len / bs) - 1. Any unlocked entry may be evicted
    (the longer ones hold every block they need)."""

    def __init__(self, *args, **kwargs):  # `BudgetedPrefixCache`'s, as `RadixPrefixCache` takes them
        super().__init__(*args, **kwargs)
        self.entries: dict[tuple[int, ...], Node] = {}

    def _prefixes_of(self, keys: np.ndarray) -> tuple[list[Node], int]:
        """The stored prefixes of `keys`, shortest first, and how far `keys` agree with any entry."""
        on_path, key_len = [], 0
        for node in self.entries.values():
            n = common_prefix_len(node.key, keys)
            key_len = max(key_len, n)
            if n == len(node.key):
                on_path.append(node)
        return sorted(on_path, key=lambda node: node.end), key_len

    def match(self, keys: np.ndarray, max_len: int) -> Match:
        on_path, key_len = self._prefixes_of(keys)
        hits = [node for node in on_path if node.end <= max_len and node.snapshot is not None]
        if not hits:
            return Match(0, key_len, (), None, None)
        best = hits[-1]
        self._stamp(node for node in on_path if node.end <= best.end)
        return Match(best.end, key_len, tuple(best.blocks), best.snapshot, best)

    def insert(self, keys: np.ndarray, block_table: list[int], snapshot: Snapshot | None) -> bool:
        p = len(keys)
        if p == 0:
            raise ValueError("cannot insert an empty prefix")
        name = tuple(keys.tolist())
        node = self.entries.get(name)
        if node is None:
            blocks = list(block_table[: -(-p // self.bs)])
            self._hold(blocks)
            node = self.entries[name] = Node(keys.copy(), 0, None, blocks, prefix_digest(keys, p))
        self._keep_snapshot(node, snapshot)
        self._stamp(self._prefixes_of(keys)[0])
        self.evict_to_budget()
        return node.snapshot is not None

    def _candidates(self) -> list[Node]:
        return [node for node in self.entries.values() if node.lock == 0]

    def _unlink(self, node: Node) -> None:
        del self.entries[tuple(node.key.tolist())]
