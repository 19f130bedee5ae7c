"""The output sink contract: where a run's rows go, and what resume reads back.

A `Sink` is one run's output location (`<output.uri>/<run_id>`), built from
`(uri, storage: StorageOptions)`; its `uri` attribute is that location in a form any process
can open (absolute for local paths), so workers build the same sink from it. Rows are tables in `OUTPUT_SCHEMA` (`sink/schema.py`).
Every implementation keeps these promises (tests/test_sink_contract.py checks them):

- `prepare()`: make the location and drop what a killed writer left (never visible output).
  Called once per run, before any other method.
- `commit(table) -> str | None`: the rows become visible atomically and exactly once. A crash
  at any point leaves either nothing of the batch visible or all of it; committing the same
  ids again (a retried batch) replaces that commit, never adds a second copy. Returns a name
  for the commit (the same for the same ids), or None for an empty table. Transient storage
  failures are retried; when retries run out `StorageError`, and nothing is committed.
- `index() -> CommittedIndex`: which ids are committed, and how (`build_index` does the
  bookkeeping from the (id, status, error_type) columns of each committed unit).
- `purge(ids) -> int`: remove the transient error rows of `ids` (ok and permanent-error rows
  stay, whatever their id), so resume can compute those ids again; a crash part-way leaves
  rows that the next `index()` / `purge()` resolve the same way. Returns the rows removed.
- `read() -> pa.Table`: every committed row, sorted by id.
- `write_summary(text)`: the run summary (JSON) beside the output, written atomically.
- `finish()`: called once at the end of a run, after the summary: drop what the commits left
  behind that is not output (an empty temp folder); never a committed row. Default: nothing.
- Nothing here creates a bucket: on an object store "directories" need no creation, and a
  missing bucket is the caller's config error (`vlbatch.pipeline.write_stage.check_output`).

A new sink (Lance, Iceberg) is one new file in `operators/sink/` with a subclass, named in
`vlbatch.pipeline.write_stage.open_sink` and in the contract test's list of sink classes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import pyarrow as pa

import vlbatch.operators.errors as errors_mod
from vlbatch.operators.sink.schema import STATUS_OK
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions

INDEX_COLUMNS = ["id", "status", "error_type"]


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
    """What is committed under one run."""

    done_ids: frozenset[str]  # ok or permanent error: never recomputed
    transient_ids: frozenset[str]  # only transient error rows: redone when resume.retry_transient
    purgeable_ids: frozenset[str]  # ids with any transient error row (transient_ids and strays beside a done row)
    files: tuple[str, ...]  # the committed units, as `commit` names them
    status_counts: dict[str, int] = field(default_factory=dict)  # every committed row
    duplicate_ids: int = 0


def build_index(units: Iterable[tuple[str, pa.Table]]) -> CommittedIndex:
    """The index from (commit name, table with INDEX_COLUMNS) per committed unit."""
    done: set[str] = set()
    transient: set[str] = set()
    seen: Counter = Counter()
    status: Counter = Counter()
    names = []
    for name, t in units:
        names.append(name)
        for rid, st, et in zip(*(t.column(c).to_pylist() for c in INDEX_COLUMNS), strict=True):
            seen[rid] += 1
            status[st] += 1
            (transient if is_retried(st, et) else done).add(rid)
    dups = sum(1 for c in seen.values() if c > 1)
    return CommittedIndex(frozenset(done), frozenset(transient - done), frozenset(transient), tuple(names),
                          dict(status), dups)


class Sink(ABC):
    """One run's output (contract in the module docstring)."""

    def __init__(self, uri: str, storage: StorageOptions = DEFAULT_STORAGE):
        self.uri, self.storage = uri, storage

    @abstractmethod
    def prepare(self) -> None: ...

    @abstractmethod
    def commit(self, table: pa.Table) -> str | None: ...

    @abstractmethod
    def index(self) -> CommittedIndex: ...

    @abstractmethod
    def purge(self, ids: Collection[str]) -> int: ...

    @abstractmethod
    def read(self) -> pa.Table: ...

    @abstractmethod
    def write_summary(self, text: str) -> None: ...

    def finish(self) -> None:
        """End of the run (module docstring); nothing to do by default."""
        return None
