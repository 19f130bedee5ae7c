"""One row per id across a run's committed parts: which rows `seal` removes.

Duplicates reach the output in two ways: the same request in different manifest blocks (each
block's expansion drops only its own duplicates), and a Ray write call run again after it had
returned (lineage reconstruction), once its batch was already published. `duplicate_rows`
decides, over every part, the one row kept per id:
- a *done* row (ok or a permanent error) before a transient error row (resume would redo
  the id otherwise);
- then the first part in name order, then the first row in the part: deterministic, so a
  crash part-way and a rerun decide the same.
The caller (`ParquetSink.seal`) rewrites each part that loses rows (the kept rows committed
first, then the old file deleted, as `purge` does): a crash in between leaves duplicates that
the next seal removes the same way.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from vlbatch.operators.sink.base import retried_mask
from vlbatch.operators.sink.ids import id_keys


def duplicate_rows(units: Iterable[tuple[str, pa.Table]]) -> dict[str, np.ndarray]:
    """(part name, table with id / status / error_type) per part -> {part name: `[rows] bool`, True
    for a row to remove}, only for parts that lose at least one row. Memory: 25 B per row (key,
    rank, part number, row number), sorted once."""
    names: list[str] = []
    keys, rank, part, row = [], [], [], []
    for i, (name, t) in enumerate(units):
        names.append(name)
        k = id_keys(t.column("id"))
        keys.append(k)
        rank.append(retried_mask(t.column("status"), t.column("error_type")).astype(np.uint8))  # 0: done
        part.append(np.full(len(k), i, np.int32))
        row.append(np.arange(len(k), dtype=np.int32))
    if not names:
        return {}
    k, r, p, w = (np.concatenate(x) for x in (keys, rank, part, row))
    if not len(k):
        return {}
    order = np.lexsort((w, p, r, k))  # by id, then done before transient, then part, then row
    ks = k[order]
    first = np.ones(len(ks), bool)
    np.not_equal(ks[1:], ks[:-1], out=first[1:])
    if first.all():
        return {}
    drop = order[~first]  # positions in the concatenation of the rows to remove
    out: dict[str, np.ndarray] = {}
    for i in np.unique(p[drop]):
        mask = np.zeros(len(keys[i]), bool)
        mask[w[drop[p[drop] == i]]] = True
        out[names[i]] = mask
    return out
