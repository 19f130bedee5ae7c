"""Passthrough columns (`input.columns.keep`): the user's columns, with their Arrow types, from
a manifest row to every output row of that media.

Rows between the stages have one fixed schema (`pipeline/stages/rows.py`), so a media's kept values
travel as one opaque `keep` cell: the Arrow IPC stream of a one-row table of those columns
(`encode`), turned back into typed columns by the writer (`decode`). The run's schema of the
kept columns (`keep_schema`, from the manifest's schema, see `Source.keep_schema`) is fixed
for the whole run: every block is cast to it, and the output schema is `OUTPUT_SCHEMA` plus
these fields (`output_schema`).
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.ipc as ipc

from vlbatch.operators.errors import InputError
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA


def output_schema(keep: pa.Schema | None) -> pa.Schema:
    """The run's output schema: `OUTPUT_SCHEMA`, then the kept columns (all nullable)."""
    if keep is None or not len(keep):
        return OUTPUT_SCHEMA
    clash = [n for n in keep.names if n in OUTPUT_SCHEMA.names]
    if clash:
        raise InputError(f"input.columns.keep: {', '.join(clash)} clash with output columns; rename them")
    return pa.schema(list(OUTPUT_SCHEMA) + [f.with_nullable(True) for f in keep])


def select(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """`table`'s kept columns cast to the run's `schema` (`InputError` naming a missing one)."""
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise InputError(f"{where}: no column {', '.join(map(repr, missing))} (input.columns.keep); "
                         f"columns are: {', '.join(table.column_names)}")
    return table.select(schema.names).cast(schema)


def encode(table: pa.Table) -> list[bytes]:
    """[n] rows of the kept columns -> n IPC blobs (one row each)."""
    out = []
    for i in range(table.num_rows):
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, table.schema) as w:
            w.write_table(table.slice(i, 1))
        out.append(sink.getvalue().to_pybytes())
    return out


def decode(blobs: list[bytes | None], repeats: list[int], schema: pa.Schema) -> pa.Table:
    """Blob i repeated `repeats[i]` times -> one table of `schema` (a null blob: null values)."""
    parts = []
    for blob, n in zip(blobs, repeats, strict=True):
        if n == 0:
            continue
        if blob is None:
            parts.append(pa.table({f.name: pa.nulls(n, f.type) for f in schema}, schema=schema))
            continue
        one = ipc.open_stream(pa.py_buffer(blob)).read_all().cast(schema)
        parts.append(one.take(pa.array([0] * n, pa.int64())))
    return pa.concat_tables(parts) if parts else schema.empty_table()


def digest(blob: bytes) -> str:
    """16 hex chars naming one row's kept values (an `encode` blob): sha256 of their JSON (sorted keys,
    non-JSON values as text), so it is the values', not the IPC encoding's (stable across pyarrow
    versions). What sets apart the request ids of one media's rows whose kept values differ."""
    import hashlib
    import json

    values = ipc.open_stream(pa.py_buffer(blob)).read_all().to_pylist()
    text = json.dumps(values, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
