"""The output sink contract: where a run's rows go, and what resume reads back.

A `Sink` is one run's output location (`<output.uri>/<run_id>`), built from
`(uri, storage: StorageOptions)`; its `uri` attribute is that location in a form any process
can open (absolute for local paths), so workers build the same sink from it. Rows are tables in
`OUTPUT_SCHEMA` (`sink/schema.py`).
Every implementation keeps these promises (tests/test_sink_contract.py checks them):

- `prepare()`: make the location and drop what a killed writer left (never visible output).
  Called once per run, before any other method.
- `commit(table) -> str | None`: the rows become visible atomically and exactly once. A crash
  at any point leaves either nothing of the batch visible or all of it; committing the same
  ids again (a retried batch) replaces that commit, never adds a second copy. Returns a name
  for the commit (the same for the same ids), or None for an empty table. Transient storage
  failures are retried; when retries run out `StorageError`, and nothing is committed.
- `index(max_tokens=None) -> CommittedIndex`: which ids are committed, and how (`build_index` does the
  bookkeeping from the (id, status, error_type) columns of each committed unit, plus `REDO_COLUMNS`
  when `max_tokens`, the rerun's `sampling.max_tokens`, is given: a `TruncatedError` row cut at fewer
  tokens is then transient, redone like one: `truncated_below`), and `clip_last` where the unit has it:
  the ids of a video's last clips, read by the rerun check.
- `purge(ids, max_tokens=None) -> int`: remove the transient error rows of `ids` (and, given
  `max_tokens`, the TruncatedError rows `truncated_below` redoes; ok and other permanent-error rows
  stay, whatever their id), so resume can compute those ids again; a crash part-way leaves
  rows that the next `index()` / `purge()` resolve the same way. Returns the rows removed.
- `stage(table, group) -> str | None`: write the rows durably but invisibly (never in
  `index()` / `read()`), under the writer `group`; a name derived from the ids.
  `unstage(group, names)`: delete staged rows once published. `seal(target_rows,
  target_bytes) -> [name]`: publish (commit, rolled at the targets) every staged row whose
  id is not committed yet, then drop all staged rows, then keep one committed row per id (a
  done row before a transient one): after `seal` no id is committed twice. `prepare()` drops staged rows (a
  killed run loses them; resume recomputes them). `sink/rolling.py` builds rolling part
  files on these three and `commit` (the design is in `sink/parquet.py`).
- `read() -> pa.Table`: every committed row, sorted by id.
- `write_summary(text)`: the run summary (JSON) beside the output, written atomically;
  `read_summary() -> str | None`: the last one written (None: none yet).
- `finish()`: called once at the end of a run, after the summary: drop what the commits left
  behind that is not output (an empty temp folder); never a committed row. Default: nothing.
- Nothing here creates a bucket: on an object store "directories" need no creation, and a
  missing bucket is the caller's config error (`vlbatch.pipeline.stages.write_stage.check_output`).

A new sink (Lance, Iceberg) is one new file in `operators/sink/` with a subclass, taking
`(uri, storage, schema)` (`schema`: `OUTPUT_SCHEMA` plus the run's kept input columns), and one
`Entry` in `SINKS` (`operators/sink/__init__.py`): `output.format` then accepts its name,
`vlbatch.pipeline.plan.sink.open_sink` builds it, and the contract test checks it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import vlbatch.operators.errors as errors_mod
from vlbatch.operators.sink.ids import KEY, IdIndex, id_keys
from vlbatch.operators.sink.schema import STATUS_OK
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions, check_output_uri

INDEX_COLUMNS = ["id", "status", "error_type", "clip_last"]  # a unit without clip_last: none last
# what decides whether a TruncatedError row is redone (`truncated_below`), read beside INDEX_COLUMNS
REDO_COLUMNS = ["finish_reason", "generated_tokens"]


def is_transient(error_type: str | None) -> bool:
    """True when an error row of this type is retried on resume: a `VlbatchError` subclass's
    `permanent` flag decides; any other exception name (a bug, an OOM) counts as transient."""
    if error_type is None:
        return False
    cls = getattr(errors_mod, error_type, None)
    if isinstance(cls, type) and issubclass(cls, errors_mod.VlbatchError):
        return not cls.permanent
    return True


def is_retried(status: str, error_type: str | None) -> bool:
    """True for a row that resume computes again (a transient error row)."""
    return status != STATUS_OK and is_transient(error_type)


@dataclass(frozen=True)
class CommittedIndex:
    """What is committed under one run. The id sets are `IdIndex` (`sink/ids.py`: 16 B per id in one
    sorted numpy array, shared zero-copy through Ray's object store), never Python sets of strings."""

    done_ids: IdIndex  # ok or permanent error: never recomputed
    transient_ids: IdIndex  # only transient error rows: redone when resume.retry_transient
    purgeable_ids: IdIndex  # ids with any transient error row (transient_ids and strays beside a done row)
    files: tuple[str, ...]  # the committed units, as `commit` names them
    status_counts: dict[str, int] = field(default_factory=dict)  # every committed row
    duplicate_ids: int = 0
    # the ids of rows with `clip_last` true (any status): a video's clip set ends at that clip
    # (`pipeline/startup/nothing_to_do.py` tells a complete clipped video from it)
    last_clip_ids: IdIndex = field(default_factory=lambda: IdIndex(np.zeros(0, KEY)))


def retried_mask(status: pa.ChunkedArray | pa.Array, error_type: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """`[N] bool`: `is_retried` per row, decided once per distinct (status, error_type)."""
    pairs = pa.table({"s": status, "e": error_type})
    uniq = pairs.group_by(["s", "e"]).aggregate([]).to_pylist()
    retried = [(u["s"], u["e"]) for u in uniq if is_retried(u["s"], u["e"])]
    mask = np.zeros(pairs.num_rows, bool)
    for st, et in retried:
        m = pc.equal(pairs["s"], st)
        m = pc.and_(m, pc.is_null(pairs["e"]) if et is None else pc.equal(pairs["e"], et))
        mask |= np.asarray(m.combine_chunks().fill_null(False).to_numpy(zero_copy_only=False), bool)
    return mask


def truncated_below(t: pa.Table, max_tokens: int | None) -> np.ndarray:
    """`[N] bool`: the `TruncatedError` rows a rerun with `max_tokens` (`sampling.max_tokens`) computes again:
    cut by the token limit (`finish_reason` "length") at fewer tokens than `max_tokens`, i.e. written under a
    smaller `max_tokens` (`generated_tokens` is the limit that cut it). An equal or smaller limit would cut it
    again: kept (a permanent error row). None, or a table without the `REDO_COLUMNS`: none."""
    n = t.num_rows
    if max_tokens is None or not n or not set(REDO_COLUMNS + ["error_type"]) <= set(t.column_names):
        return np.zeros(n, bool)
    m = pc.and_(pc.equal(t.column("error_type"), "TruncatedError"), pc.equal(t.column("finish_reason"), "length"))
    m = pc.and_(m, pc.less(t.column("generated_tokens"), max_tokens))
    return np.asarray(pc.fill_null(m, False).to_numpy(zero_copy_only=False), bool)


def redone_mask(t: pa.Table, max_tokens: int | None = None) -> np.ndarray:
    """`[N] bool`: the rows resume computes again: transient error rows (`retried_mask`) and, given the rerun's
    `max_tokens`, the TruncatedError rows it can finish (`truncated_below`)."""
    return retried_mask(t.column("status"), t.column("error_type")) | truncated_below(t, max_tokens)


def _sorted_unique(chunks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique keys, the keys that occur more than once) of the concatenated chunks
    (sorted in place: ~33 B per key at the peak)."""
    keys = np.concatenate(chunks) if chunks else np.zeros(0, KEY)
    chunks.clear()
    keys.sort()
    first = np.ones(len(keys), bool)
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    repeated = keys[1:][~first[1:]]
    return keys[first], np.unique(repeated)


def build_index(units: Iterable[tuple[str, pa.Table]], max_tokens: int | None = None) -> CommittedIndex:
    """The index from (commit name, table with INDEX_COLUMNS, and REDO_COLUMNS where `max_tokens` is given) per
    committed unit; vectorised (16 B per committed row kept, about 33 B at the peak while the keys are sorted).
    `max_tokens`: the rerun's `sampling.max_tokens`; the TruncatedError rows it redoes count as transient."""
    done: list[np.ndarray] = []
    transient: list[np.ndarray] = []
    last: list[np.ndarray] = []
    status: Counter = Counter()
    names = []
    for name, t in units:
        names.append(name)
        keys = id_keys(t.column("id"))
        mask = redone_mask(t, max_tokens)
        done.append(keys[~mask])
        transient.append(keys[mask])
        if "clip_last" in t.column_names:
            is_last = t.column("clip_last").combine_chunks().fill_null(False).to_numpy(zero_copy_only=False)
            last.append(keys[np.asarray(is_last, bool)])
        for v in t.column("status").value_counts().to_pylist():
            status[v["values"]] += v["counts"]
    done_u, done_rep = _sorted_unique(done)
    trans_u, trans_rep = _sorted_unique(transient)
    done_ix, trans_ix = IdIndex(done_u), IdIndex(trans_u)
    both = trans_u[done_ix.contains_many(trans_u)]  # an id with a done row and a transient row
    dups = len(np.unique(np.concatenate([done_rep, trans_rep, both])))
    return CommittedIndex(done_ix, trans_ix - done_ix, trans_ix, tuple(names), dict(status), dups,
                          IdIndex.from_keys(np.concatenate(last) if last else np.zeros(0, KEY)))


class Sink(ABC):
    """One run's output (contract in the module docstring)."""

    def __init__(self, uri: str, storage: StorageOptions = DEFAULT_STORAGE):
        check_output_uri(uri)  # persistent filesystems only (storage/options.OUTPUT_PROTOCOLS): never memory://
        self.uri, self.storage = uri, storage

    @abstractmethod
    def prepare(self) -> None: ...

    @abstractmethod
    def commit(self, table: pa.Table) -> str | None: ...

    @abstractmethod
    def index(self, max_tokens: int | None = None) -> CommittedIndex: ...

    @abstractmethod
    def purge(self, ids: Collection[str], max_tokens: int | None = None) -> int: ...

    @abstractmethod
    def stage(self, table: pa.Table, group: str) -> str | None: ...

    @abstractmethod
    def unstage(self, group: str, names: Collection[str]) -> None: ...

    @abstractmethod
    def seal(self, target_rows: int | None = None, target_bytes: int | None = None) -> list[str]: ...

    @abstractmethod
    def read(self) -> pa.Table: ...

    @abstractmethod
    def write_summary(self, text: str) -> None: ...

    @abstractmethod
    def read_summary(self) -> str | None: ...

    def finish(self) -> None:
        """End of the run (module docstring); nothing to do by default."""
        return None
