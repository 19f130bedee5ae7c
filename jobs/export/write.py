"""The file `vlbatch export` writes: Parquet, JSONL or CSV, streamed, local or s3://, never seen half-written.

Formats of nested values (the rows' `timings` struct, `quality_flags` list, `parsed` JSON; the media
layout's structs, lists and dictionaries):
- parquet: the Arrow types as they are (zstd); `parsed` keeps Arrow's JSON extension type.
- jsonl: one JSON object per line; structs are objects, lists arrays, dictionaries their string, and a
  JSON column (`parsed`, a prompt typed as JSON text) is embedded as the JSON value itself, not a string;
  binary -> base64 text, NaN / infinity -> null, dates and times -> ISO 8601 text.
- csv: a header line, then one line per row (pyarrow's CSV writer: nulls are empty cells, strings quoted);
  a nested cell (struct, list, map) holds its JSON text, a JSON column its JSON text, dictionaries their
  string, binary base64 text.

Where it lands: locally a temp file beside DEST (`<name>.<32 hex>.vlbatch-tmp`), renamed onto DEST
when complete; on s3:// a multipart upload (fsspec's file), completed at the end and aborted on a failure,
so DEST is either the whole previous object or the whole new one.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import math
import os
import uuid

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from vlbatch.operators.storage import StorageOptions, filesystem, is_object_store
from vlbatch.operators.storage.io import TMP_MARK

FORMATS = ("parquet", "jsonl", "csv")
JSONL_BATCH = 8192  # rows turned into Python objects at a time


def _is_json(t: pa.DataType) -> bool:
    return isinstance(t, pa.BaseExtensionType) and t.extension_name == "arrow.json"


def _plain(v):
    """A Python value from Arrow -> something json.dumps takes (see the module docstring)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dt.date | dt.time | dt.datetime):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    return v if v is None or isinstance(v, str | int | bool) else str(v)


def _embed(text):
    """A JSON column's cell -> its value (text that is not JSON stays text)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def jsonl_chunks(table: pa.Table):
    """`table` as JSONL text, `JSONL_BATCH` lines per chunk (module docstring)."""
    json_cols = [f.name for f in table.schema if _is_json(f.type)]
    for batch in table.to_batches(max_chunksize=JSONL_BATCH):
        out = []
        for row in batch.to_pylist():
            for c in json_cols:
                row[c] = _embed(row[c])
            out.append(json.dumps(_plain(row), ensure_ascii=False, allow_nan=False))
        yield "".join(line + "\n" for line in out)


def csv_cells(table: pa.Table) -> pa.Table:
    """`table` with every column one pyarrow's CSV writer takes (module docstring)."""
    cols = []
    for f, col in zip(table.schema, table.columns, strict=True):
        if _is_json(f.type):
            col = pa.chunked_array([c.storage for c in col.chunks], pa.string()) if col.num_chunks else \
                pa.chunked_array([], pa.string())
        elif pa.types.is_dictionary(f.type):
            col = col.cast(f.type.value_type)
        elif pa.types.is_nested(f.type):
            col = pa.array([None if v is None else json.dumps(_plain(v), ensure_ascii=False, allow_nan=False)
                            for v in col.to_pylist()], pa.string())
        elif pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type):
            col = pa.array([None if v is None else base64.b64encode(v).decode() for v in col.to_pylist()],
                           pa.string())
        cols.append(col)
    return pa.table(cols, names=table.column_names)


class ExportFile:
    """DEST opened for streaming one format (module docstring): `write(table)` as many times as needed,
    then `commit()`; `abort()` leaves DEST as it was. `schema`: every table's schema (also an empty
    export's: a Parquet file or CSV header with no rows)."""

    def __init__(self, dest: str, fmt: str, schema: pa.Schema, storage: StorageOptions):
        self.fs, self.path = filesystem(dest, storage)
        self.fmt, self.schema = fmt, schema
        self.remote = is_object_store(self.fs)
        if not self.remote:
            parent = os.path.dirname(self.path) or "."
            self.fs.makedirs(parent, exist_ok=True)
        self.tmp = self.path if self.remote else f"{self.path}.{uuid.uuid4().hex}{TMP_MARK}"
        self.f = self.fs.open(self.tmp, "wb")
        self.pq = pq.ParquetWriter(self.f, schema, compression="zstd") if fmt == "parquet" else None
        self.csv = pacsv.CSVWriter(self.f, csv_cells(schema.empty_table()).schema) if fmt == "csv" else None

    def write(self, table: pa.Table) -> None:
        table = table.select(self.schema.names).cast(self.schema) if not table.schema.equals(self.schema) else table
        if self.pq is not None:
            self.pq.write_table(table)
        elif self.csv is not None:
            self.csv.write_table(csv_cells(table))
        else:
            for chunk in jsonl_chunks(table):
                self.f.write(chunk.encode())

    def commit(self) -> None:
        for w in (self.pq, self.csv):
            if w is not None:
                w.close()
        self.f.close()  # s3: completes the multipart upload (the object appears whole)
        if not self.remote:
            os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.pq is not None:  # no footer: the temp file goes (else its __del__ writes to the closed file)
            self.pq.is_open = False
        try:
            if self.remote:
                self.f.discard()  # s3fs: abort the multipart upload; nothing appears
            else:
                self.f.close()
                os.remove(self.tmp)
        except (OSError, AttributeError):
            pass
