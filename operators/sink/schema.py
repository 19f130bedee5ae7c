"""The output row: one fixed Arrow schema for every row, ok or error.

`OutputRow` is the frozen in-memory form; `OUTPUT_SCHEMA` the Arrow/Parquet form.
Every batch a sink commits has exactly this schema (same field order, same types,
nullability), so a reader can concatenate all files of a run without casting, and an
error row never changes the schema (it fills the answer/token columns with nulls).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

import pyarrow as pa

# `parsed`: a structured answer's value as JSON text; Arrow's JSON extension type (pyarrow >= 19, a string
# column underneath, kept in Parquet), else a plain string column
PARSED_TYPE = pa.json_() if hasattr(pa, "json_") else pa.string()

STATUS_OK = "ok"
STATUS_ERROR = "error"

TIMINGS_TYPE = pa.struct(
    [
        pa.field("decode_s", pa.float64()),  # media read + decode (per media, shared by its requests)
        pa.field("preprocess_s", pa.float64()),  # resize, patchify, tokenise (per media)
        # wall time of the model-stage call holding this request (queue + generation)
        pa.field("model_s", pa.float64()),
    ]
)

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("request_index", pa.int32(), nullable=False),
        pa.field("media_uri", pa.string()),  # null where the manifest had null (an InputError row)
        pa.field("media_type", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_name", pa.string()),  # task.questions' name (q<index> by default), "caption"; null: manifest's
        pa.field("answer", pa.string()),
        pa.field("parsed", PARSED_TYPE),  # a constrained prompt's validated value (JSON); null for free text
        pa.field("thinking", pa.string()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error_type", pa.string()),
        pa.field("error_message", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("visual_tokens", pa.int32()),
        pa.field("generated_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        # caption-quality flags of an ok answer (`operators/quality.py`); [] clean, null on error rows
        pa.field("quality_flags", pa.list_(pa.string())),
        pa.field("model", pa.string(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("timings", TIMINGS_TYPE),
        # video.clips: the clip of the source this row is about (null for images and whole videos)
        pa.field("clip_index", pa.int32()),
        pa.field("clip_start_s", pa.float64()),  # seconds in the source's timeline
        pa.field("clip_end_s", pa.float64()),
        pa.field("clip_source", pa.string()),  # scenes | fixed (a scene detector that failed falls back)
        pa.field("clip_uri", pa.string()),  # the clip's file (output.clip_files); null when off or not written
        pa.field("clip_last", pa.bool_()),  # true on the rows of a video's last clip: its clip set is complete
    ]
)


@dataclass(frozen=True)
class Timings:
    decode_s: float | None = None
    preprocess_s: float | None = None
    model_s: float | None = None


@dataclass(frozen=True)
class OutputRow:
    """One request's result. `status` is "ok" or "error"; error rows carry
    `error_type` (the `VlbatchError` subclass name) and `error_message`."""

    id: str
    request_index: int
    media_uri: str | None  # None: the manifest's media_uri was null (an InputError row)
    media_type: str
    prompt: str
    status: Literal["ok", "error"]
    model: str
    run_id: str
    answer: str | None = None
    thinking: str | None = None
    prompt_name: str | None = None
    parsed: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    prompt_tokens: int | None = None
    visual_tokens: int | None = None
    generated_tokens: int | None = None
    finish_reason: str | None = None
    quality_flags: tuple[str, ...] | None = None
    timings: Timings = Timings()
    clip_index: int | None = None
    clip_start_s: float | None = None
    clip_end_s: float | None = None
    clip_source: str | None = None
    clip_uri: str | None = None
    clip_last: bool | None = None


_NAMES = [f.name for f in fields(OutputRow)]
assert set(_NAMES) == set(OUTPUT_SCHEMA.names)  # code invariant, not user input


def rows_to_table(rows: list[OutputRow]) -> pa.Table:
    """[OutputRow] -> Table with OUTPUT_SCHEMA (column order of the schema)."""
    cols: dict[str, list] = {name: [] for name in OUTPUT_SCHEMA.names}
    for r in rows:
        for name in OUTPUT_SCHEMA.names:
            v = getattr(r, name)
            cols[name].append(asdict(v) if name == "timings" else v)
    return pa.Table.from_pydict(cols, schema=OUTPUT_SCHEMA)


def table_to_rows(table: pa.Table) -> list[OutputRow]:
    """Table (any column order, same names) -> [OutputRow]."""
    out = []
    for d in table.select(OUTPUT_SCHEMA.names).to_pylist():
        t = d.pop("timings") or {}
        flags = d.pop("quality_flags")
        out.append(OutputRow(**d, quality_flags=None if flags is None else tuple(flags), timings=Timings(**t)))
    return out
