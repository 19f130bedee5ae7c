"""Prefix caches behind one contract (`PrefixCache`): the radix tree over prompt keys with
hybrid (KV + DeltaNet) snapshots (`RadixPrefixCache`), and `NoPrefixCache` (caching off).

Keys: `KeyCodec.encode(request) -> int64 [L]`. Text tokens keep their id (>= 0); media
placeholders become `-(uid << 24 | offset) - 1` where `uid` is a unique integer interned
per media content hash and `offset` the placeholder's row in that item. Two prompts share
a key prefix iff their text and their media contents agree, so equal text around
different images can never match (uids are assigned from a dict of full sha256 hashes,
never from a truncated hash).

Radix tree blocks: node covering positions [s, e) holds the blocks of block indices
s // bs .. ceil(e / bs) - 1; a block straddling a node boundary is referenced by both
nodes. For a path the right block of index j is that of the deepest node covering j,
whose data for positions up to its end are valid for the path. A block fully inside
[0, m) is shared by reference; the tail block of a match ending mid-block must be
copied by the caller (copy-on-write: the original stays with the tree). Eviction: least
recently used unlocked leaves first, down to `budget_bytes` (counted as snapshot bytes
plus distinct KV blocks held by the tree), or until the block manager has `n` free
blocks (`evict_blocks`); a leaf that queued requests expect to reuse (`expect`) goes only
after every other one (a video's prefix is not dropped while its other questions wait).
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.engine.caches.block_manager import BlockManager
from vlbatch.operators.engine.caches.branch_points import common_prefix_len, plan_branch_points, prefix_digest
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
    """A prefix hit: positions [0, length) are served from `blocks` + `snapshot`."""

    length: int
    key_len: int
    blocks: tuple[int, ...]
    snapshot: Snapshot | None
    node: Node | None


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


class PrefixCache(ABC):
    """What the scheduler and the engine use of a prefix cache (they never ask which one).

    - `branch_points(requests, keys) -> [tuple[int, ...]]`: per request (keys [L] each),
      the prompt positions 0 < p < L, ascending, where the scheduler cuts prefill chunks,
      snapshots the DeltaNet states and `insert`s. A cache that keeps nothing plans none,
      so the scheduler never snapshots for it.
    - `match(keys, max_len) -> Match`: the deepest position `m <= max_len` on the key path
      where a DeltaNet snapshot is stored, the KV blocks that hold positions [0, m), the
      snapshot, and `key_len` (how far the keys agree with the cache, snapshot or not: a
      branch point the caller should snapshot at). No hit: `Match(0, key_len, (), None, None)`.
    - `insert(keys, block_table, snapshot) -> Node | None`: record that positions
      [0, len(keys)) are computed in `block_table` with DeltaNet states `snapshot` at
      position len(keys); the cache takes its own references on the blocks it keeps.
      Returns the node now holding position len(keys), None when nothing was recorded.
    - `lock(node)` / `unlock(node)` (`Match.node`, None for a miss): while locked a node
      and its ancestors are never evicted (a running request restores from / copies
      out of them).
    - `evict_blocks(n) -> bool`: drop unlocked entries until the block manager has `n`
      free blocks; False if impossible.
    - `expect(digests)` / `unexpect(digests)` (`branch_points.prefix_digest` of a queued
      request's keys at its planned branch points): while expected, a prefix is evicted only
      after every unexpected one (a preference, never a lock: KV memory always comes first).
    - `stats() -> dict`: `prefix_cache_bytes` (held now) and `prefix_evicted_nodes`.
    """

    @abstractmethod
    def branch_points(self, requests, keys: list[np.ndarray]) -> list[tuple[int, ...]]: ...

    @abstractmethod
    def match(self, keys: np.ndarray, max_len: int) -> Match: ...

    @abstractmethod
    def insert(self, keys: np.ndarray, block_table: list[int], snapshot: Snapshot | None) -> Node | None: ...

    @abstractmethod
    def lock(self, node: Node | None) -> None: ...

    @abstractmethod
    def unlock(self, node: Node | None) -> None: ...

    @abstractmethod
    def evict_blocks(self, n: int) -> bool: ...

    @abstractmethod
    def expect(self, digests) -> None: ...

    @abstractmethod
    def unexpect(self, digests) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...


class NoPrefixCache(PrefixCache):
    """Prefix caching off: plans no branch points, never matches, keeps nothing."""

    def branch_points(self, requests, keys: list[np.ndarray]) -> list[tuple[int, ...]]:
        return [()] * len(keys)

    def match(self, keys: np.ndarray, max_len: int) -> Match:
        return Match(0, 0, (), None, None)

    def insert(self, keys: np.ndarray, block_table: list[int], snapshot: Snapshot | None) -> None:
        return None

    def lock(self, node: Node | None) -> None:
        pass

    def unlock(self, node: Node | None) -> None:
        pass

    def evict_blocks(self, n: int) -> bool:
        return False

    def expect(self, digests) -> None:
        pass

    def unexpect(self, digests) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_bytes": 0, "prefix_evicted_nodes": 0}


class RadixPrefixCache(PrefixCache):
    """The radix tree; see the module docstring for its keys, blocks and eviction. On
    `insert` existing nodes keep their blocks; a new leaf takes references on the new blocks."""

    def __init__(self, blocks: BlockManager, block_bytes: int, budget_bytes: int):
        self.bm = blocks
        self.bs = blocks.block_size
        self.block_bytes = block_bytes
        self.budget_bytes = budget_bytes
        self.root = Node(np.zeros(0, np.int64), 0, None, [])
        self._held: Counter[int] = Counter()  # block id -> references held by tree nodes
        self._snap_bytes = 0
        self._clock = itertools.count(1)
        self.evicted_nodes = 0
        self._expected: Counter[bytes] = Counter()  # prefix digest -> queued requests expecting it

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

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_bytes": self.nbytes, "prefix_evicted_nodes": self.evicted_nodes}

    def expect(self, digests) -> None:
        self._expected.update(digests)

    def unexpect(self, digests) -> None:
        self._expected.subtract(digests)
        for d in digests:
            if self._expected[d] <= 0:
                del self._expected[d]

    # -- planning --------------------------------------------------------------------------
    def branch_points(self, requests, keys: list[np.ndarray]) -> list[tuple[int, ...]]:
        """Where the prompts of one call branch off each other, plus the end of each media item
        (so a later call with the same media reuses it), spaced by one KV block (`spaced`).

        Every candidate is a property of the prefix before it (a branch of the call's trie, a
        media's end), never of the rest of the prompt, so `spaced` keeps the same points on every
        prompt through a shared prefix: siblings that share [system, A] and go on to different
        text or a second media C all snapshot at A's end, and the scheduler holds them back
        until the first has computed it. (Only the last media's end as a candidate broke this:
        [system, A, question] kept A's end, [system, A, C, ...] the branch one token after it.)"""
        return [spaced(set(bp) | {m.spans[-1][1] for m in r.media}, r.prompt_len, self.bs)
                for r, bp in zip(requests, plan_branch_points(keys), strict=False)]

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
        stamp = next(self._clock)
        table: dict[int, int] = {}
        for node in path:
            node.last_used = stamp
            first = node.start // self.bs
            for i, b in enumerate(node.blocks):
                table[first + i] = b
            if node is best:
                break
        m = best.end
        blocks = tuple(table[j] for j in range(-(-m // self.bs)))
        return Match(m, key_len, blocks, best.snapshot, best)

    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock -= 1
            node = node.parent

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

    def insert(self, keys: np.ndarray, block_table: list[int], snapshot: Snapshot | None) -> Node:
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
        if node.snapshot is None and snapshot is not None:
            node.snapshot = snapshot
            self._snap_bytes += snapshot.nbytes
        stamp = next(self._clock)
        n = node
        while n is not None and n is not self.root:
            n.last_used = stamp
            n = n.parent
        self.evict_to_budget()
        return node

    # -- eviction --------------------------------------------------------------------------
    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.lock == 0:
                out.append(node)
        return out

    def _remove(self, node: Node) -> None:
        del node.parent.children[int(node.key[0])]
        self._release(node.blocks)
        if node.snapshot is not None:
            self._snap_bytes -= node.snapshot.nbytes
        node.blocks, node.snapshot = [], None
        self.evicted_nodes += 1

    def _evict_until(self, done) -> bool:
        while not done():
            leaves = self._leaves()
            if not leaves:
                return False
            for leaf in sorted(leaves, key=lambda n: (self._expected[n.digest] > 0, n.last_used)):
                self._remove(leaf)
                if done():
                    return True
        return True

    def evict_to_budget(self) -> None:
        self._evict_until(lambda: self.nbytes <= self.budget_bytes)

    def evict_blocks(self, n: int) -> bool:
        """Evict unlocked LRU leaves until `n` KV blocks are free; False if impossible."""
        return self._evict_until(lambda: self.bm.num_free >= n)

    def clear(self) -> None:
        """Drop every unlocked node."""
        self._evict_until(lambda: False)
