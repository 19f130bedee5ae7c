"""Output sinks: one contract (`base.Sink`), Parquet as its implementation, one row schema.

- `schema`: `OutputRow` (frozen) and `OUTPUT_SCHEMA` (Arrow), one schema for ok and error rows.
- `base`: the `Sink` contract (commit exactly once, committed index, purge, read, summary),
  `CommittedIndex`, `is_transient` (which error rows resume retries).
- `parquet`: `ParquetSink`, deterministic atomically committed part files.
Ray-free.
"""
from vlbatch.operators.sink.base import CommittedIndex, Sink, is_transient
from vlbatch.operators.sink.parquet import ParquetSink, part_name
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA, OutputRow, Timings, rows_to_table, table_to_rows

__all__ = ["OUTPUT_SCHEMA", "CommittedIndex", "OutputRow", "ParquetSink", "Sink", "Timings", "is_transient",
           "part_name", "rows_to_table", "table_to_rows"]
