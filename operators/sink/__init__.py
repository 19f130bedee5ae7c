"""Output sinks: one contract (`base.Sink`), Parquet as its implementation, one row schema.

- `schema`: `OutputRow` (frozen) and `OUTPUT_SCHEMA` (Arrow), one schema for ok and error rows.
- `base`: the `Sink` contract (commit exactly once, committed index, purge, read, summary),
  `CommittedIndex`, `is_transient` (which error rows resume retries).
- `parquet`: `ParquetSink`, deterministic atomically committed part files.

`SINKS` names the implementations: the job config's `output.format` and its schema take their
choices from it, `new_sink` builds the chosen one as `target(uri, storage, schema)` (for
`pipeline/plan/sink.open_sink`), and tests/test_sink_contract.py checks every one. Importing
this package imports nothing heavy (no pyarrow): a sink's module is imported when chosen.
A new sink (Lance, Iceberg): its module (a `Sink` subclass) and one `Entry` below.
Ray-free.
"""
from __future__ import annotations

from vlbatch.operators.registry import Entry, Registry

SINKS = Registry("output format", "output.format", "parquet", (
    Entry("parquet", "vlbatch.operators.sink.parquet:ParquetSink",
          "zstd Parquet part files under <output.uri>/<run_id>/, rolled by part_mb / part_rows / commit_interval_s"),
), group="vlbatch.sinks")

__all__ = ["SINKS", "new_sink"]


def new_sink(name: str, uri: str, storage, schema):
    """The `base.Sink` called `name` in `SINKS` at `uri` (`storage`: `StorageOptions`; `schema`:
    `OUTPUT_SCHEMA` plus the run's kept input columns)."""
    return SINKS.load(name)(uri, storage, schema)
