"""Resume bookkeeping: what a run has already committed, and what to redo.

Why not Ray Data's `CheckpointConfig` (ray 2.60, `ray.data.checkpoint`): we evaluated it
against our requirements and it does not fit:
1. It filters rows at the *read* operator by an id column of the source data. Our
   unit of work is a request (one per question), whose id exists only after the
   manifest row is expanded; a manifest row with three questions, one of them done,
   must still run the other two.
2. It checkpoints every row that reaches the sink, whatever its status; we must retry
   transient error rows (StorageError, MediaTimeoutError, EngineError) and keep
   permanent ones. There is no per-row predicate.
3. Its checkpoint files are a second source of truth beside the output; a crash between
   the data write and the checkpoint write can lose or duplicate a row unless both are
   tied by its 2-phase commit, which only its own datasinks implement. We write Parquet
   ourselves (one fixed schema, deterministic names).
4. Its default deletes the checkpoint on success and needs a pyarrow filesystem on a
   cluster-shared path; our output is already on shared storage.
So the output itself is the checkpoint: the committed part files are read (only the
`id`, `status`, `error_type` columns) into a `CommittedIndex` before the pipeline starts.

Resume rules:
- an id with an `ok` row or a *permanent* error row is done and is not recomputed;
- transient error rows are purged (the part file is rewritten without them: the new
  file is committed first, then the old one deleted; a crash in between leaves two
  files whose shared rows are resolved the same way on the next start), and their ids
  run again;
- error types are judged by `vlbatch.operators.errors`: a `VlbatchError` subclass's
  `permanent` flag; any other exception name (a bug, an OOM) counts as transient.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import vlbatch.operators.errors as errors_mod
from vlbatch.operators.writer.commit import PART_PREFIX, PART_SUFFIX, TMP_DIR, commit_table, with_retries
from vlbatch.operators.writer.fs import join
from vlbatch.operators.writer.schema import STATUS_OK

INDEX_COLUMNS = ["id", "status", "error_type"]


def is_transient(error_type: str | None) -> bool:
    """True when an error row of this type is retried on resume."""
    if error_type is None:
        return False
    cls = getattr(errors_mod, error_type, None)
    if isinstance(cls, type) and issubclass(cls, errors_mod.VlbatchError):
        return not cls.permanent
    return True


@dataclass(frozen=True)
class CommittedIndex:
    """What is committed under one run directory."""

    done_ids: frozenset[str]  # ok or permanent error: never recomputed
    transient_ids: frozenset[str]  # only transient error rows: redone when resume.retry_transient
    transient_files: tuple[str, ...]  # part files holding transient error rows
    files: tuple[str, ...]
    status_counts: dict[str, int] = field(default_factory=dict)  # every committed row
    duplicate_ids: int = 0


def list_parts(fs: fsspec.AbstractFileSystem, run_dir: str) -> list[str]:
    if not fs.exists(run_dir):
        return []
    names = fs.ls(run_dir, detail=False)
    return sorted(
        n for n in names if n.rsplit("/", 1)[-1].startswith(PART_PREFIX) and n.endswith(PART_SUFFIX)
    )


def _read_cols(fs, path: str, columns: list[str], retries: int) -> pa.Table:
    def go():
        with fs.open(path, "rb") as f:
            return pq.read_table(f, columns=columns)

    return with_retries(go, what=f"read {path}", retries=retries)


def load_index(fs: fsspec.AbstractFileSystem, run_dir: str, *, retries: int = 5) -> CommittedIndex:
    files = list_parts(fs, run_dir)
    done: set[str] = set()
    transient: set[str] = set()
    seen: Counter = Counter()
    status: Counter = Counter()
    transient_files = []
    for path in files:
        t = _read_cols(fs, path, INDEX_COLUMNS, retries)
        has_transient = False
        for rid, st, et in zip(*(t.column(c).to_pylist() for c in INDEX_COLUMNS), strict=True):
            seen[rid] += 1
            status[st] += 1
            if st == STATUS_OK or not is_transient(et):
                done.add(rid)
            else:
                transient.add(rid)
                has_transient = True
        if has_transient:
            transient_files.append(path)
    dups = sum(1 for c in seen.values() if c > 1)
    return CommittedIndex(frozenset(done), frozenset(transient - done), tuple(transient_files), tuple(files),
                          dict(status), dups)


def purge_transient(fs: fsspec.AbstractFileSystem, run_dir: str, index: CommittedIndex, *, retries: int = 5) -> int:
    """Rewrite each part file holding transient error rows without them.

    The kept rows are committed first (deterministic name), then the old file is
    deleted; both steps are idempotent, so a crash in between is repaired by the next
    call. Returns the number of rows purged.
    """
    purged = 0
    for path in index.transient_files:
        t = _read_cols(fs, path, None, retries)
        keep = [
            st == STATUS_OK or not is_transient(et)
            for st, et in zip(t.column("status").to_pylist(), t.column("error_type").to_pylist(), strict=True)
        ]
        kept = t.filter(pa.array(keep))
        purged += t.num_rows - kept.num_rows
        new_path = commit_table(fs, run_dir, kept, retries=retries)
        if new_path != path:
            with_retries(lambda p=path: fs.rm_file(p), what=f"delete {path}", retries=retries)
    return purged


def clean_tmp(fs: fsspec.AbstractFileSystem, run_dir: str) -> None:
    """Remove temp files a killed writer left (never visible as committed output)."""
    tmp = join(run_dir, TMP_DIR)
    if fs.exists(tmp):
        fs.rm(tmp, recursive=True)


def read_committed(fs: fsspec.AbstractFileSystem, run_dir: str, *, retries: int = 5) -> pa.Table:
    """All committed rows of a run as one table (OUTPUT_SCHEMA), sorted by id."""
    from vlbatch.operators.writer.schema import OUTPUT_SCHEMA

    tables = [_read_cols(fs, p, None, retries) for p in list_parts(fs, run_dir)]
    if not tables:
        return OUTPUT_SCHEMA.empty_table()
    t = pa.concat_tables(tables)
    return t.take(pc.sort_indices(t, [("id", "ascending")]))
