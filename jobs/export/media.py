"""`vlbatch export --layout media`: a run's rows pivoted to one row per media (per clip), typed columns.

Output columns: `media_uri`, `media_type`, `clip_index`, `clip_start_s`, `clip_end_s`, `clip_source`, `clip_uri`, then
per prompt `<name>` (typed from its response format: `jobs/export/types.py`) and `<name>_status` (ok /
error; null where the media has no row for that prompt): the caption first, then task.questions' names in
the config's order, then the other names seen (a manifest's unnamed questions are `q<request_index>`),
then the run's `keep` columns. A prompt's name is the row's `prompt_name`; a row without one is
`caption` in caption mode, else `q<request_index>`.

A media is the key (media_uri, clip_index, kept values): rows of one media_uri that the manifest gave
different kept values are separate media (as the run keeps them: `pipeline/stages/requests.py`). Two rows
for one prompt of one media (an unsealed run's copies): the ok one, else the first.

Bounded memory at any run size, two passes (why: the rows of one media can be in any part - a resumed
run commits a media's later requests in later parts - so a single streaming pass would have to hold
every media not yet complete, i.e. possibly the whole run; sorting the run externally costs more I/O
than hashing it once):
1. `bucket_tables` reads the run part by part (the columns the layout needs) and appends each part's
   rows, hash-partitioned by media_uri (blake2b, so one media always lands in one bucket), to N
   temporary Parquet files in a local temp folder; N = ceil(run rows / bucket_rows), so a bucket holds
   about `bucket_rows` rows (N is capped at `MAX_BUCKETS` open files: past 10^8 rows at the default
   buckets grow; raise --bucket-rows with the memory to match). A run of at most one bucket is grouped
   straight from its parts. Pass 1 holds one part and N Parquet writers (bench_export: 200 of them
   cost less than one 100k-row bucket).
2. each bucket is read whole (bounded by `bucket_rows`), sorted by key, pivoted (`pivot`: vectorised,
   a per-value Python check only for constrained prompts) and handed to the writer before the next is read.
Media rows come out bucket by bucket, sorted by media_uri and clip_index inside a bucket.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlbatch.jobs.export.types import FREE_TEXT, Misfit, Typed, prompt_type
from vlbatch.operators.errors import ConfigError
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA

CAPTION = "caption"
MEDIA_COLUMNS = ("media_uri", "media_type", "clip_index", "clip_start_s", "clip_end_s", "clip_source", "clip_uri")
READ_COLUMNS = [*MEDIA_COLUMNS, "request_index", "prompt_name", "answer", "parsed", "status"]
NAME = "_name"  # the prompt's column name, computed in pass 1
DEFAULT_BUCKET_ROWS = 200_000
MAX_BUCKETS = 512  # temp files open at once in pass 1 (under the common limit of 1024 descriptors)


@dataclass(frozen=True)
class MediaSpec:
    """What the media layout needs of the run: its prompts' types (name -> Typed, in column order),
    whether it is caption mode, and its kept columns (the parts' columns beyond OUTPUT_SCHEMA)."""

    prompts: tuple[tuple[str, Typed], ...]
    caption_mode: bool
    keep: pa.Schema

    def schema(self) -> pa.Schema:
        fields = [OUTPUT_SCHEMA.field(c).with_nullable(True) for c in MEDIA_COLUMNS]
        for name, typed in self.prompts:
            fields += [pa.field(name, typed.type), pa.field(f"{name}_status", pa.string())]
        return pa.schema(fields + list(self.keep))


def task_prompts(task) -> list[tuple[str, Typed]]:
    """The configured prompts (caption first where the task captions), typed by their formats."""
    from vlbatch.pipeline.config.answers import question_names

    out = []
    if task.mode == "caption" or task.caption:
        out.append((CAPTION, prompt_type(task.response_format)))
    if task.mode != "caption":
        out += [(n, prompt_type(q.response_format)) for n, q in zip(question_names(task.questions), task.questions,
                                                                   strict=True)]
    return out


def make_spec(task, seen: Iterable[str], keep: pa.Schema) -> MediaSpec:
    """The spec from the task config and the names seen in the rows (unconfigured ones: free text,
    sorted, `q<i>` by i); `ConfigError` when two columns would share a name."""
    prompts = task_prompts(task)
    known = {n for n, _ in prompts}
    extra = sorted(set(seen) - known, key=lambda n: (not n.startswith("q"), len(n), n))
    prompts += [(n, FREE_TEXT) for n in extra]
    spec = MediaSpec(tuple(prompts), task.mode == "caption", keep)
    names = spec.schema().names  # ArrowInvalid is not raised for duplicates: check by hand
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"--layout media: column {dup[0]!r} would be both a prompt's (or its _status) and "
                          "another column (a kept input column or a media column); export --layout rows instead")
    return spec


def named(table: pa.Table, caption_mode: bool, keep: pa.Schema) -> pa.Table:
    """A part's columns the layout reads (a missing one null), plus `NAME` (module docstring)."""
    n = table.num_rows
    cols = {c: table[c] if c in table.column_names else pa.nulls(n, OUTPUT_SCHEMA.field(c).type)
            for c in READ_COLUMNS}
    for f in keep:
        cols[f.name] = table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(n, f.type)
    fallback = (pa.array([CAPTION] * n, pa.string()) if caption_mode else
                pc.binary_join_element_wise("q", pc.cast(cols["request_index"], pa.string()), ""))
    cols[NAME] = pc.coalesce(cols["prompt_name"], fallback)
    cols["parsed"] = _storage(cols["parsed"])
    return pa.table(cols)


def _storage(col):
    """The JSON extension column as its plain string storage (sorting / take / concat work on it)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return col.storage if isinstance(col, pa.ExtensionArray) else col.cast(pa.string())


def bucket_of(uris: pa.Array | pa.ChunkedArray, n: int) -> np.ndarray:
    """Each row's bucket in [0, n): blake2b of its media_uri (a null uri: bucket 0), each distinct uri hashed once."""
    enc = pc.dictionary_encode(uris).combine_chunks() if isinstance(uris, pa.ChunkedArray) else \
        pc.dictionary_encode(uris)
    per_value = np.array([int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "little") % n
                          for v in enc.dictionary.to_pylist()] + [0], np.int64)
    idx = enc.indices.fill_null(len(enc.dictionary)).to_numpy(zero_copy_only=False)
    return per_value[idx]


def bucket_tables(tables: Iterable[pa.Table], rows: int, bucket_rows: int, folder: str) -> Iterator[pa.Table]:
    """Pass 1 then pass 2's input (module docstring): `tables` (`named` parts) -> each bucket's rows, one
    bucket at a time. `rows`: the run's row count (sizes N); `folder`: the temp folder for the buckets."""
    n = min(MAX_BUCKETS, max(1, math.ceil(rows / max(1, bucket_rows))))
    if n == 1:  # the whole run fits one bucket: no temp files
        parts = list(tables)
        if parts:
            yield pa.concat_tables(parts)
        return
    writers: dict[int, pq.ParquetWriter] = {}
    try:
        for t in tables:
            which = bucket_of(t["media_uri"], n)
            for b in np.unique(which).tolist():
                if b not in writers:
                    writers[b] = pq.ParquetWriter(os.path.join(folder, f"bucket-{b:05d}.parquet"), t.schema)
                writers[b].write_table(t.filter(pa.array(which == b)))
    finally:
        for w in writers.values():
            w.close()
    for b in sorted(writers):
        path = os.path.join(folder, f"bucket-{b:05d}.parquet")
        table = pq.read_table(path)
        os.remove(path)  # the temp folder holds less and less
        yield table


def _key_columns(t: pa.Table, keep: pa.Schema) -> list[str]:
    """The key's columns; a nested kept column is compared through a `_key_<name>` JSON text column."""
    return ["media_uri", "clip_index"] + [f"_key_{f.name}" if _nested(f.type) else f.name for f in keep]


def _nested(t: pa.DataType) -> bool:
    return pa.types.is_nested(t) or isinstance(t, pa.BaseExtensionType)


def _with_text_keys(t: pa.Table, keep: pa.Schema) -> pa.Table:
    """`t` with a `_key_<name>` JSON text column per nested kept column (`_key_columns`)."""
    for f in keep:
        if _nested(f.type):
            text = [None if v is None else json.dumps(v, sort_keys=True, default=str) for v in t[f.name].to_pylist()]
            t = t.append_column(f"_key_{f.name}", pa.array(text, pa.string()))
    return t


def media_count(media_rows: pa.Table, keep: pa.Schema) -> tuple[int, int]:
    """(media, clips) among one bucket's pivoted rows: a media is its key less `clip_index` (a video's clips
    are one media), a clip a row with a `clip_index`. A media_uri's rows are all in one bucket."""
    keys = [k for k in _key_columns(media_rows, keep) if k != "clip_index"]
    media = _with_text_keys(media_rows, keep).select(keys).group_by(keys, use_threads=False).aggregate([])
    return media.num_rows, media_rows.num_rows - media_rows["clip_index"].null_count


def _with_keys(t: pa.Table, keep: pa.Schema) -> pa.Table:
    t = _with_text_keys(t, keep)
    rank = pc.if_else(pc.equal(t["status"], "ok"), 0, 1)  # an ok copy before an error one
    return t.append_column("_rank", rank)


def _group_ids(t: pa.Table, keys: list[str]) -> np.ndarray:
    """Group number of each row of `t` (sorted by `keys`): a new group where any key differs from the row above."""
    n = t.num_rows
    new = np.zeros(n, bool)
    if n:
        new[0] = True
    for k in keys:
        col = t[k].combine_chunks()
        a, b = col.slice(1), col.slice(0, max(0, n - 1))
        differ = pc.fill_null(pc.not_equal(a, b), False)
        nulls = pc.xor(pc.is_null(a), pc.is_null(b))
        if pa.types.is_floating(col.type):  # NaN == NaN for a key
            differ = pc.and_(differ, pc.invert(pc.and_(pc.is_nan(a), pc.is_nan(b))).fill_null(True))
        new[1:] |= pc.or_(differ, nulls).to_numpy(zero_copy_only=False)
    return np.cumsum(new) - 1


def pivot(t: pa.Table, spec: MediaSpec) -> pa.Table:
    """One bucket's rows (`named`) -> its media rows in `spec.schema()` (module docstring)."""
    t = _with_keys(t, spec.keep)
    keys = _key_columns(t, spec.keep)
    t = t.take(pc.sort_indices(t, [(k, "ascending", "at_end") for k in [*keys, NAME, "_rank"]]))
    groups = _group_ids(t, keys)
    n_media = int(groups[-1]) + 1 if len(groups) else 0
    first = np.flatnonzero(np.diff(groups, prepend=-1) != 0)
    out = {c: t[c].take(pa.array(first)) for c in MEDIA_COLUMNS}
    names = t[NAME].to_numpy(zero_copy_only=False)
    for name, typed in spec.prompts:
        rows = np.flatnonzero(names == name)
        media, at = np.unique(groups[rows], return_index=True)  # the first (best-ranked) row of each media
        rows = rows[at]
        values, status = _values(t, rows, typed)
        out[name] = _spread(values, media, n_media)
        out[f"{name}_status"] = _spread(status, media, n_media)
    for f in spec.keep:
        out[f.name] = t[f.name].take(pa.array(first))
    return pa.table(out, schema=spec.schema())


def _spread(values: pa.Array, media: np.ndarray, n_media: int) -> pa.Array:
    """values[i] at row media[i] of an n_media-row column, null elsewhere."""
    idx = np.zeros(n_media, np.int64)
    has = np.zeros(n_media, bool)
    idx[media] = np.arange(len(media))
    has[media] = True
    return values.take(pa.array(idx, mask=~has))


def _values(t: pa.Table, rows: np.ndarray, typed: Typed) -> tuple[pa.Array, pa.Array]:
    """(value, status) of the chosen rows of one prompt: free text its answer; a constrained prompt its
    parsed value checked into the type (a misfit: null, status error)."""
    take = pa.array(rows, pa.int64())
    status = t["status"].take(take).combine_chunks()
    if typed is FREE_TEXT:
        return t["answer"].take(take).combine_chunks(), status
    out, fixed = [], []
    for ok, text in zip(status.to_pylist(), t["parsed"].take(take).to_pylist(), strict=True):
        value = None
        if ok == "ok":
            try:
                if text is None:
                    raise Misfit("no parsed value")
                value = json.loads(text)
                value = None if value is None else typed.check(value)  # JSON null: a nullable schema's value
            except (Misfit, ValueError, TypeError):  # not JSON, or not the type: the grammar never lets this through
                value, ok = None, "error"
        out.append(value)
        fixed.append(ok)
    return pa.array(out, typed.type), pa.array(fixed, pa.string())
