"""Parquet output: the fixed row schema, atomic deterministic commits, resume bookkeeping.

- `schema`: `OutputRow` (frozen) and `OUTPUT_SCHEMA` (Arrow), one schema for ok and error rows.
- `commit`: `commit_table` writes one part file atomically under a name hashed from its ids.
- `resume`: `load_index` / `purge_transient` read what a run committed and what to redo.
- `fs`: `open_filesystem` for local paths and s3:// (s3fs).
Ray-free.
"""
from vlbatch.operators.writer.commit import commit_table, part_name, write_json
from vlbatch.operators.writer.fs import open_filesystem
from vlbatch.operators.writer.resume import (
    CommittedIndex,
    clean_tmp,
    is_transient,
    load_index,
    purge_transient,
    read_committed,
)
from vlbatch.operators.writer.schema import OUTPUT_SCHEMA, OutputRow, Timings, rows_to_table, table_to_rows

__all__ = [
    "OUTPUT_SCHEMA", "CommittedIndex", "OutputRow", "Timings", "clean_tmp", "commit_table", "is_transient",
    "load_index", "open_filesystem", "part_name", "purge_transient", "read_committed", "rows_to_table",
    "table_to_rows", "write_json",
]
