"""Reading the manifest with Ray Data (Parquet, JSONL, CSV, or a glob of media files).

Local paths and s3:// are read through the one storage layer (`vlbatch.operators.storage`:
s3fs with the job's storage options; for Ray Data's readers a pyarrow filesystem whose calls
follow the one retry policy). The result is a dataset with exactly three
columns, whatever the source: `media_uri` (string), `media_type` (string or null),
`questions` (list<string> or null). Relative media paths in a manifest are resolved
against the manifest's folder.
"""
from __future__ import annotations

import posixpath

import pyarrow as pa
import ray

from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.operators.storage import arrow_filesystem, filesystem, with_retries
from vlbatch.operators.storage.options import protocol_of, with_protocol
from vlbatch.pipeline.config import JobConfig

COLUMNS = ("media_uri", "media_type", "questions")


def _resolve(uri: str, base: str) -> str:
    """Manifest-relative media paths -> absolute (same protocol as the manifest)."""
    if "://" in uri or uri.startswith("/"):
        return uri
    return posixpath.normpath(posixpath.join(base, uri))


def normalise(table: pa.Table, cfg: JobConfig, base_uri: str) -> pa.Table:
    """Any manifest block -> (media_uri, media_type, questions)."""
    cols = cfg.input.columns
    if cols.media not in table.column_names:
        raise InputError(f"manifest has no column {cols.media!r} (input.columns.media); "
                         f"columns are: {', '.join(table.column_names)}")
    uris = [_resolve(str(u), base_uri) for u in table.column(cols.media).to_pylist()]
    n = len(uris)
    mtype = table.column(cols.media_type).to_pylist() if cols.media_type in table.column_names else [None] * n
    if cols.questions:
        if cols.questions not in table.column_names:
            raise InputError(f"manifest has no column {cols.questions!r} (input.columns.questions)")
        qs = [_json_list(q) if isinstance(q, str) else (None if q is None else [str(x) for x in q])
              for q in table.column(cols.questions).to_pylist()]
    else:
        qs = [None] * n
    return pa.table({
        "media_uri": pa.array(uris, pa.string()),
        "media_type": pa.array([None if m is None else str(m) for m in mtype], pa.string()),
        "questions": pa.array(qs, pa.list_(pa.string())),
    })


def _json_list(s: str) -> list[str]:
    import json

    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        return [s]
    return [str(x) for x in v] if isinstance(v, list) else [str(v)]


def task_pool(size: int | None):
    """The compute strategy of a function stage: at most `size` tasks at once (None: Ray Data's choice)."""
    return ray.data.TaskPoolStrategy(size=size)


def read_manifest(cfg: JobConfig, *, num_cpus: float | None = None,
                  concurrency: int | None = None) -> ray.data.Dataset:
    """The manifest as a Ray dataset of (media_uri, media_type, questions); `num_cpus` per
    read task (None: Ray Data's default of 1), at most `concurrency` tasks at once (None: Ray
    Data's choice)."""
    inp = cfg.input
    storage = cfg.storage.options()
    fs, path = filesystem(inp.uri, storage)

    def retried(fn, what: str):
        return with_retries(fn, what=f"{what} {inp.uri}", storage=storage)

    if inp.format == "glob":
        matches = sorted(retried(lambda: fs.glob(path), "listing"))
        if not matches:
            raise ConfigError(f"input.uri: the glob {inp.uri!r} matches no files")
        items = [{"media_uri": with_protocol(inp.uri, m), "media_type": None, "questions": None} for m in matches]
        ds = ray.data.from_arrow(pa.Table.from_pylist(
            items, schema=pa.schema([("media_uri", pa.string()), ("media_type", pa.string()),
                                     ("questions", pa.list_(pa.string()))])))
    else:
        if not retried(lambda: fs.exists(path) or fs.glob(path), "listing"):
            raise ConfigError(f"input.uri: {inp.uri!r} does not exist")
        pafs = None if protocol_of(inp.uri) == "file" else arrow_filesystem(fs, storage)
        if inp.format == "parquet":
            ds = ray.data.read_parquet(path, filesystem=pafs, num_cpus=num_cpus, concurrency=concurrency)
        elif inp.format == "jsonl":
            ds = ray.data.read_json(path, filesystem=pafs, lines=True, num_cpus=num_cpus,
                                   concurrency=concurrency)
        else:
            ds = ray.data.read_csv(path, filesystem=pafs, num_cpus=num_cpus, concurrency=concurrency)
        base = path if retried(lambda: fs.isdir(path), "listing") else posixpath.dirname(path)
        base = with_protocol(inp.uri, base)
        ds = ds.map_batches(normalise, batch_format="pyarrow", fn_kwargs={"cfg": cfg, "base_uri": base},
                            num_cpus=num_cpus, compute=task_pool(concurrency), zero_copy_batch=True)
    if inp.limit is not None:
        ds = ds.limit(inp.limit)
    return ds
