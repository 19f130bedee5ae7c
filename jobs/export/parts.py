"""The parts `vlbatch export` reads, checked against the rules `jobs/export/command.py` states (its docstring).

`scan_parts` reads every part's footer (its columns, its row count) and then its `id`, `status` and
`error_type` columns, one part at a time: a part without a column every part has (`REQUIRED`: `id`, `status`,
`request_index`, `prompt`, ...), or whose `id` / `status` is not text or null, is a `BadPart` naming the file;
the rows that repeat an id are found by the rule the run's own `seal` keeps
(`operators/sink/dedupe.duplicate_rows`: a done row before a transient one, then the first part in name
order, then the first row), 25 B per row held while it decides, as `seal` holds. `read_part` then gives a
part's rows less those repeats, each column in the run's type (one that does not cast: a `BadPart` naming the
file and the column), its `parsed` values checked as JSON text (not JSON: a `BadPart` naming the file and the
row's id).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlbatch.operators.sink.dedupe import duplicate_rows
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA

KEY_COLUMNS = ["id", "status", "error_type"]  # what decides which row of an id is exported
# every part of a run has these, never null (`id`, `status`, `request_index`, `prompt`, ...): else not a part
REQUIRED = tuple(f.name for f in OUTPUT_SCHEMA if not f.nullable)


class BadPart(ValueError):
    """A file among the run's parts that breaks the export's rules: one line, naming the file."""


@dataclass(frozen=True)
class RunParts:
    """What `scan_parts` found: the part `paths` (sorted), the run's `schema` (OUTPUT_SCHEMA, then every kept
    column a part has), the `rows` exported (one per id) and, per part that repeats an id, the rows dropped."""

    paths: tuple[str, ...]
    schema: pa.Schema
    rows: int
    dropped: Mapping[str, np.ndarray]


def scan_parts(sink: ParquetSink, paths: list[str]) -> RunParts:
    """The run's parts checked (module docstring) -> `RunParts`; `BadPart` for the first that breaks a rule."""
    extra: dict[str, pa.Field] = {}
    total = 0
    for p in paths:
        schema, n = _footer(sink, p)
        total += n
        for name in REQUIRED:
            if name not in schema.names:
                raise BadPart(f"{p}: no {name!r} column: not a part of a vlbatch run (move it out of the run folder)")
        for name in ("id", "status"):
            if not pa.types.is_string(schema.field(name).type) and not pa.types.is_large_string(
                    schema.field(name).type):
                raise BadPart(f"{p}: its {name!r} column is {schema.field(name).type}, not text: not a part of a "
                              "vlbatch run")
        for f in schema:
            if f.name not in OUTPUT_SCHEMA.names:
                extra.setdefault(f.name, f.with_nullable(True))
    dropped = duplicate_rows((p, _keys(sink, p)) for p in paths)
    rows = total - sum(int(m.sum()) for m in dropped.values())
    return RunParts(tuple(paths), pa.schema(list(OUTPUT_SCHEMA) + list(extra.values())), rows, dropped)


def _footer(sink: ParquetSink, path: str) -> tuple[pa.Schema, int]:
    def go():
        with sink.fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            return pf.schema_arrow, pf.metadata.num_rows

    try:
        return sink._retry(go, f"reading {path}")
    except pa.ArrowInvalid as e:
        raise BadPart(f"{path}: not a Parquet file ({_first_line(e)})") from None


def _keys(sink: ParquetSink, path: str) -> pa.Table:
    t = sink.read_part(path, KEY_COLUMNS)
    _no_nulls(path, t)
    if "error_type" not in t.column_names:
        t = t.append_column("error_type", pa.nulls(t.num_rows, pa.string()))
    return t


def _no_nulls(path: str, t: pa.Table) -> None:
    for name in REQUIRED:
        nulls = t[name].null_count if name in t.column_names else 0
        if nulls:
            raise BadPart(f"{path}: {nulls} row(s) with a null {name!r}: not a part of a vlbatch run")


def read_part(sink: ParquetSink, parts: RunParts, path: str, columns: list[str] | None = None) -> pa.Table:
    """The part's `columns` (None: all) less the rows `scan_parts` dropped, its `parsed` checked (module
    docstring)."""
    want = None if columns is None else list(dict.fromkeys([*columns, "id"]))
    t = _typed(path, sink.read_part(path, want), parts.schema)
    _no_nulls(path, t)
    drop = parts.dropped.get(path)
    if drop is not None:
        t = t.filter(pa.array(~drop))
    if "parsed" in t.column_names:
        _check_parsed(path, t)
    return t


def _typed(path: str, t: pa.Table, schema: pa.Schema) -> pa.Table:
    """`t`'s columns in the run schema's types (a part of an older run: a column cast, as a reader would);
    a value that does not cast is a `BadPart` naming the file and the column."""
    for i, f in enumerate(t.schema):
        want = schema.field(f.name).type if f.name in schema.names else f.type
        if f.type == want:
            continue
        if f.name == "parsed" and not (pa.types.is_string(f.type) or pa.types.is_large_string(f.type)):
            raise BadPart(f"{path}: its 'parsed' column is {f.type}, not JSON text")
        try:
            t = t.set_column(i, pa.field(f.name, want), t.column(i).cast(want))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise BadPart(f"{path}: its {f.name!r} column is {f.type}, not {want} ({_first_line(e)})") from None
    return t


def _check_parsed(path: str, t: pa.Table) -> None:
    col = t["parsed"].combine_chunks()
    text = col.storage if isinstance(col, pa.ExtensionArray) else col
    if text.null_count == len(text):
        return
    ids = None
    for i, value in enumerate(text.to_pylist()):
        if value is None:
            continue
        try:
            json.loads(value)
        except ValueError as e:
            ids = t["id"].to_pylist() if ids is None else ids
            raise BadPart(f"{path}: row {ids[i]}: its parsed value is not JSON ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
