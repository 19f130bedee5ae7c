"""Prefix caches behind one storage contract (`PrefixCache`): the radix tree over prompt keys
with hybrid (KV + DeltaNet) snapshots (`RadixPrefixCache`), its naive twin, a dict of exact
prefixes (`prefix_cache_naive.DictPrefixCache`), and `NoPrefixCache` (caching off). Which
prefixes are worth storing, and which to evict last, is the planner's
(`prefix_planner.PrefixPlanner`); a cache stores, matches, locks and evicts.

Keys: `KeyCodec.encode(request) -> int64 [L]`. Text tokens keep their id (>= 0); media
placeholders become `-(uid << 24 | offset) - 1` where `uid` is a unique integer interned
per media content hash and `offset` the placeholder's row in that item. Two prompts share
a key prefix iff their text and their media contents agree, so equal text around
different images can never match (uids are assigned from a dict of full sha256 hashes,
never from a truncated hash).

Radix tree blocks: node covering positions [s, e) holds the blocks of block indices
s // bs .. ceil(e / bs) - 1; a block straddling a node boundary is referenced by both
nodes. For a path the right block of index j is that of the deepest node covering j,
whose data for positions up to its end are valid for the path. Eviction takes unlocked
leaves only (an inner node goes once its subtree has).
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.engine.caches.block_manager import BlockManager
from vlbatch.operators.engine.caches.branch_points import common_prefix_len, prefix_digest
from vlbatch.operators.engine.caches.state_pool import Snapshot

_OFFSET_BITS = 24


class KeyCodec:
    """Prompt -> int64 keys; media content hashes interned to unique ids (bounded LRU of hashes).

    Forgetting an old hash is safe: it is re-interned with a fresh id, which can only cause
    a miss, never a false hit (ids are never reused).
    """

    def __init__(self, max_hashes: int = 1 << 20):
        self._ids: OrderedDict[str, int] = OrderedDict()
        self._next = itertools.count(1)
        self._max = max_hashes

    def media_id(self, content_hash: str) -> int:
        uid = self._ids.get(content_hash)
        if uid is None:
            uid = self._ids[content_hash] = next(self._next)
            if len(self._ids) > self._max:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(content_hash)
        return uid

    def encode(self, token_ids, media) -> np.ndarray:
        """[L] int64 keys of a prompt whose media items are `media` (MediaItem with spans)."""
        keys = np.asarray(token_ids, dtype=np.int64).copy()
        for item in media:
            pos = item.positions()
            if len(pos) >= 1 << _OFFSET_BITS:
                raise ValueError("media item with more than 2**24 placeholders")
            uid = self.media_id(item.content_hash)
            keys[pos] = -((uid << _OFFSET_BITS) | np.arange(len(pos), dtype=np.int64)) - 1
        return keys


class Node:
    __slots__ = ("key", "start", "parent", "children", "blocks", "snapshot", "lock", "last_used", "digest")

    def __init__(self, key: np.ndarray, start: int, parent: Node | None, blocks: list[int],
                 digest: bytes | None = None):
        self.key = key
        self.digest = digest  # prefix_digest of the keys [0, end): what `expect` names
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.blocks = blocks  # block ids of block indices start // bs .. ceil(end / bs) - 1
        self.snapshot: Snapshot | None = None
        self.lock = 0
        self.last_used = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass(frozen=True)
class Match:
    """A prefix hit: positions [0, length) are served from `blocks` + `snapshot`; `node` is
    the cache's handle for `lock` / `unlock`."""

    length: int
    key_len: int
    blocks: tuple[int, ...]
    snapshot: Snapshot | None
    node: Node | None


class PrefixCache(ABC):
    """Storage of computed prompt prefixes: what the scheduler matches, inserts, locks and
    evicts (it never asks which cache it has; what to store and when is the planner's).

    - `match(keys, max_len) -> Match`: the longest stored prefix keys[:m], m <= max_len, that
      holds a DeltaNet snapshot; the KV blocks that hold positions [0, m) (block index j
      covers positions j * bs .. (j + 1) * bs - 1); the snapshot; `key_len`, how far the keys
      agree with any stored prefix, snapshot or not (a branch off the cache: the scheduler
      snapshots there); a handle for `lock`. No hit: `Match(0, key_len, (), None, None)`. A
      hit counts as a use of the prefix and of every stored prefix of it (LRU).
    - `insert(keys, block_table, snapshot) -> bool`: positions [0, len(keys)) are computed in
      `block_table` with DeltaNet states `snapshot` at position len(keys). The cache takes
      its own references (`BlockManager.incref`) on the blocks it keeps and never writes
      them; the tail block of a later match ending mid-block is copied by the caller
      (copy-on-write). A prefix already stored keeps its blocks (and its snapshot). Returns
      whether a snapshot is stored at len(keys) afterwards (the insert may evict, its own
      entry included, to stay within the byte budget).
    - `lock(node)` / `unlock(node)` (`Match.node`, None for a miss): while locked, the hit's
      blocks and snapshot are never evicted (a running request restores from / copies out
      of them).
    - `evict_blocks(n) -> bool`: drop unlocked entries until the block manager has `n` free
      blocks; False if impossible.
    - `stats() -> dict`: `prefix_cache_bytes` (held now) and `prefix_evicted_nodes`.

    Caches that store (`BudgetedPrefixCache`) take `(blocks, block_bytes, budget_bytes,
    keep_last)` and evict least recently used entries first, down to `budget_bytes` (snapshot
    bytes plus distinct KV blocks held) on insert, or until `evict_blocks` is met; entries
    whose prefix digest (`branch_points.prefix_digest`) `keep_last` names go only after every
    other one (a preference, never a lock: KV memory always comes first).
    """

    @abstractmethod
    def match(self, keys: np.ndarray, max_len: int) -> Match: ...

    @abstractmethod
    def insert(self, keys: np.ndarray, block_table: list[int], snapshot: Snapshot | None) -> bool: ...

    @abstractmethod
    def lock(self, node: Node | None) -> None: ...

    @abstractmethod
    def unlock(self, node: Node | None) -> None: ...

    @abstractmethod
    def evict_blocks(self, n: int) -> bool: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...


class NoPrefixCache(PrefixCache):
    """Prefix caching off: never matches, keeps nothing."""

    def match(self, keys: np.ndarray, max_len: int) -> Match:
        return Match(0, 0, (), None, None)

    def insert(self, keys: np.ndarray, block_table: list[int], snapshot: Snapshot | None) -> bool:
        return False

    def lock(self, node: Node | None) -> None:
        pass

    def unlock(self, node: Node | None) -> None:
        pass

    def evict_blocks(self, n: int) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_bytes": 0, "prefix_evicted_nodes": 0}


def _never(digest: bytes | None) -> bool:
    return False


class BudgetedPrefixCache(PrefixCache):
    """What every storing cache shares: block references and byte accounting, locks up a
    node's parents, and eviction in the contract's order. A subclass finds its entries
    (`match`, `insert`), names the eviction candidates (`_candidates`: unlocked entries whose
    removal leaves every other entry whole) and unlinks one (`_unlink`)."""

    def __init__(self, blocks: BlockManager, block_bytes: int, budget_bytes: int,
                 keep_last: Callable[[bytes | None], bool] = _never):
        self.bm = blocks
        self.bs = blocks.block_size
        self.block_bytes = block_bytes
        self.budget_bytes = budget_bytes
        self.keep_last = keep_last
        self._held: Counter[int] = Counter()  # block id -> references held by entries
        self._snap_bytes = 0
        self._clock = itertools.count(1)
        self.evicted_nodes = 0

    # -- accounting ----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._snap_bytes + len(self._held) * self.block_bytes

    def _hold(self, blocks) -> None:
        self.bm.incref(blocks)
        self._held.update(blocks)

    def _release(self, blocks) -> None:
        self.bm.decref(blocks)
        self._held.subtract(blocks)
        for b in blocks:
            if self._held[b] <= 0:
                del self._held[b]

    def _keep_snapshot(self, node: Node, snapshot: Snapshot | None) -> None:
        if node.snapshot is None and snapshot is not None:
            node.snapshot = snapshot
            self._snap_bytes += snapshot.nbytes

    def _stamp(self, nodes: Iterable[Node]) -> None:
        stamp = next(self._clock)
        for node in nodes:
            node.last_used = stamp

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_bytes": self.nbytes, "prefix_evicted_nodes": self.evicted_nodes}

    # -- locks -----------------------------------------------------------------------------
    def lock(self, node: Node | None) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None:
            node.lock -= 1
            node = node.parent

    # -- eviction --------------------------------------------------------------------------
    @abstractmethod
    def _candidates(self) -> list[Node]: ...

    @abstractmethod
    def _unlink(self, node: Node) -> None: ...

    def _rank(self, node: Node):
        """Eviction order: unexpected before expected, least recently used first, longer first."""
        return self.keep_last(node.digest), node.last_used, -node.end

    def _remove(self, node: Node) -> None:
        self._unlink(node)
        self._release(node.blocks)
        if node.snapshot is not None:
            self._snap_bytes -= node.snapshot.nbytes
        node.blocks, node.snapshot = [], None
        self.evicted_nodes += 1

    def _evict_until(self, done) -> bool:
        while not done():
            victims = self._candidates()
            if not victims:
                return False
            for node in sorted(victims, key=self._rank):
                self._remove(node)
                if done():
                    return True
        return True

    def evict_to_budget(self) -> None:
        self._evict_until(lambda: self.nbytes <= self.budget_bytes)

    def evict_blocks(self, n: int) -> bool:
        """Evict unlocked LRU entries until `n` KV blocks are free; False if impossible."""
        return self._evict_until(lambda: self.bm.num_free >= n)

    def clear(self) -> None:
        """Drop every unlocked entry."""
        self._evict_until(lambda: False)


class RadixPrefixCache(BudgetedPrefixCache):
    """The radix tree; see the module docstring for its keys and blocks. On `insert` existing
    nodes keep their blocks; a new leaf takes references on the new blocks."""

    def __init__(self, blocks: BlockManager, block_bytes: int, budget_bytes: int,
                 keep_last: Callable[[bytes | None], bool] = _never):
        super().__init__(blocks, block_bytes, budget_bytes, keep_last)
        self.root = Node(np.zeros(0, np.int64), 0, None, [])

    # -- lookup ----------------------------------------------------------------------------
    def _walk(self, keys: np.ndarray):
        """Nodes fully on the key path, plus (partial child, agreed length) where it stops."""
        node, pos, path = self.root, 0, []
        while pos < len(keys):
            child = node.children.get(int(keys[pos]))
            if child is None:
                return path, None, pos
            n = common_prefix_len(child.key, keys[pos:])
            if n < len(child.key):
                return path, child, pos + n
            path.append(child)
            node, pos = child, pos + n
        return path, None, pos

    def match(self, keys: np.ndarray, max_len: int) -> Match:
        path, _, key_len = self._walk(keys)
        best = None
        for node in path:
            if node.end > max_len:
                break
            if node.snapshot is not None:
                best = node
        if best is None:
            return Match(0, key_len, (), None, None)
        used = path[: path.index(best) + 1]
        self._stamp(used)
        table: dict[int, int] = {}
        for node in used:
            first = node.start // self.bs
            for i, b in enumerate(node.blocks):
                table[first + i] = b
        m = best.end
        blocks = tuple(table[j] for j in range(-(-m // self.bs)))
        return Match(m, key_len, blocks, best.snapshot, best)

    # -- insertion -------------------------------------------------------------------------
    def _split(self, child: Node, n: int, keys: np.ndarray) -> Node:
        """Cut `child` after n keys; returns the new parent node [start, start + n) (`keys`:
        a key path through it)."""
        bs, s = self.bs, child.start
        cut = s + n
        head_blocks = child.blocks[: -(-cut // bs) - s // bs]
        mid = Node(child.key[:n], s, child.parent, head_blocks, prefix_digest(keys, cut))
        mid.lock, mid.last_used = child.lock, child.last_used
        tail_first = cut // bs - s // bs
        if cut % bs:  # the straddling block is now held by both halves
            self._hold([child.blocks[tail_first]])
        child.blocks = child.blocks[tail_first:]
        child.key, child.start, child.parent = child.key[n:], cut, mid
        mid.children[int(child.key[0])] = child
        mid.parent.children[int(mid.key[0])] = mid
        return mid

    def insert(self, keys: np.ndarray, block_table: list[int], snapshot: Snapshot | None) -> bool:
        """Record positions [0, len(keys)) computed in `block_table`, states `snapshot` at the end."""
        p = len(keys)
        if p == 0:
            raise ValueError("cannot insert an empty prefix")
        path, partial, pos = self._walk(keys)
        parent = path[-1] if path else self.root
        if partial is not None:
            parent = self._split(partial, pos - partial.start, keys)
        if pos < p:
            bs = self.bs
            new_blocks = list(block_table[pos // bs: -(-p // bs)])
            self._hold(new_blocks)
            leaf = Node(keys[pos:p].copy(), pos, parent, new_blocks, prefix_digest(keys, p))
            parent.children[int(keys[pos])] = leaf
            parent = leaf
        node = parent
        self._keep_snapshot(node, snapshot)
        self._stamp(self._ancestry(node))
        self.evict_to_budget()
        return node.snapshot is not None

    def _ancestry(self, node: Node) -> list[Node]:
        out = []
        while node is not None and node is not self.root:
            out.append(node)
            node = node.parent
        return out

    # -- eviction --------------------------------------------------------------------------
    def _candidates(self) -> list[Node]:
        """Unlocked leaves."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.lock == 0:
                out.append(node)
        return out

    def _unlink(self, node: Node) -> None:
        del node.parent.children[int(node.key[0])]
