"""`IdIndex`: a set of request ids as one sorted numpy array of 16-byte keys.

The committed index of a run can hold 10^8 ids; a Python `frozenset` of 32-char strings
costs ~100 B per id and is copied into every task that receives it. Here an id is its 16
raw bytes (the 32 hex chars of `request_id`; any other string: blake2b-128 of it), kept
sorted in one `[N] S16` array: 16 B per committed id, looked up by binary search
(`contains_many`, vectorised). Ray pickles the array out of band, so one `ray.put` of an
`IdIndex` is shared zero-copy (read-only) by every worker on a node.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

KEY = np.dtype("S16")
_HEX = np.full(256, 255, np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint8)


def _key(s: str) -> bytes:
    try:
        if len(s) == 32:
            return bytes.fromhex(s)
    except ValueError:
        pass
    return hashlib.blake2b(s.encode(), digest_size=16).digest()


def id_keys(ids) -> np.ndarray:
    """Request ids (a pyarrow string array / chunked array, or any iterable of str) -> `[N] S16` keys,
    in order. 32-hex-char ids (all of ours) are decoded without a Python loop."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
    if isinstance(ids, pa.Array):
        ids = ids.cast(pa.string())
        n = len(ids)
        if n and ids.null_count == 0:
            offsets = np.frombuffer(ids.buffers()[1], np.int32)[ids.offset: ids.offset + n + 1]
            if offsets[-1] - offsets[0] == 32 * n and np.all(np.diff(offsets) == 32):
                raw = np.frombuffer(ids.buffers()[2], np.uint8)[offsets[0]: offsets[-1]].reshape(n, 32)
                nib = _HEX[raw]
                if not (nib == 255).any():
                    return ((nib[:, 0::2] << 4) | nib[:, 1::2]).view(KEY).reshape(n)
        ids = ids.to_pylist()
    return np.array([_key(s) for s in ids], dtype=KEY).reshape(-1)


class IdIndex:
    """An immutable set of ids (`keys`: sorted unique `[N] S16`). Supports `in`, `len`, `|`,
    `==` (with another IdIndex or any collection of str) and `contains_many`."""

    __slots__ = ("keys",)

    def __init__(self, keys: np.ndarray):
        self.keys = keys

    @classmethod
    def of(cls, ids: Iterable[str] | IdIndex) -> IdIndex:
        if isinstance(ids, IdIndex):
            return ids
        return cls.from_keys(id_keys(ids if isinstance(ids, (pa.Array, pa.ChunkedArray)) else list(ids)))

    @classmethod
    def from_keys(cls, keys: np.ndarray) -> IdIndex:
        """Any `[N] S16` keys (unsorted, repeated)."""
        return cls(np.unique(np.asarray(keys, KEY)))

    def contains_many(self, ids) -> np.ndarray:
        """`[N] bool`: which of `ids` (strings, or `S16` keys) are in the set."""
        q = ids if isinstance(ids, np.ndarray) and ids.dtype == KEY else id_keys(ids)
        if not len(self.keys) or not len(q):
            return np.zeros(len(q), bool)
        pos = np.searchsorted(self.keys, q)
        return self.keys[np.minimum(pos, len(self.keys) - 1)] == q

    def __contains__(self, rid: str) -> bool:
        return bool(self.contains_many([rid])[0])

    def __len__(self) -> int:
        return len(self.keys)

    def __or__(self, other) -> IdIndex:
        return IdIndex.from_keys(np.concatenate([self.keys, IdIndex.of(other).keys]))

    def __sub__(self, other) -> IdIndex:
        return IdIndex(self.keys[~IdIndex.of(other).contains_many(self.keys)])

    def __eq__(self, other) -> bool:
        if not isinstance(other, (IdIndex, set, frozenset, list, tuple)):
            return NotImplemented
        return np.array_equal(self.keys, IdIndex.of(other).keys)

    __hash__ = None

    def __repr__(self) -> str:
        return f"IdIndex({len(self)} ids)"

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes
