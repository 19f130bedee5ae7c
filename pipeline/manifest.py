"""Reading the manifest with Ray Data (Parquet, JSONL, CSV, or a glob of media files).

Local paths and s3:// are read through one fsspec filesystem (s3fs with the job's
storage options, wrapped for pyarrow). The result is a dataset with exactly three
columns, whatever the source: `media_uri` (string), `media_type` (string or null),
`questions` (list<string> or null). Relative media paths in a manifest are resolved
against the manifest's folder.
"""
from __future__ import annotations

import posixpath

import pyarrow as pa
import ray
from pyarrow.fs import FSSpecHandler, PyFileSystem

from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.operators.writer.fs import open_filesystem, split_protocol
from vlbatch.pipeline.config import JobConfig

COLUMNS = ("media_uri", "media_type", "questions")


def _fs(cfg: JobConfig, uri: str):
    s = cfg.storage
    return open_filesystem(uri, endpoint_url=s.endpoint_url, region=s.region, anonymous=s.anonymous,
                           retries=s.retries)


def _with_proto(proto: str, path: str) -> str:
    return path if proto == "file" else f"{proto}://{path}"


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
    proto, _ = split_protocol(inp.uri)
    fs, path = _fs(cfg, inp.uri)
    if inp.format == "glob":
        matches = sorted(fs.glob(path))
        if not matches:
            raise ConfigError(f"input.uri: the glob {inp.uri!r} matches no files")
        items = [{"media_uri": _with_proto(proto, m), "media_type": None, "questions": None} for m in matches]
        ds = ray.data.from_arrow(pa.Table.from_pylist(
            items, schema=pa.schema([("media_uri", pa.string()), ("media_type", pa.string()),
                                     ("questions", pa.list_(pa.string()))])))
    else:
        if not fs.exists(path) and not fs.glob(path):
            raise ConfigError(f"input.uri: {inp.uri!r} does not exist")
        pafs = None if proto == "file" else PyFileSystem(FSSpecHandler(fs))
        if inp.format == "parquet":
            ds = ray.data.read_parquet(path, filesystem=pafs, num_cpus=num_cpus, concurrency=concurrency)
        elif inp.format == "jsonl":
            ds = ray.data.read_json(path, filesystem=pafs, lines=True, num_cpus=num_cpus,
                                   concurrency=concurrency)
        else:
            ds = ray.data.read_csv(path, filesystem=pafs, num_cpus=num_cpus, concurrency=concurrency)
        base = posixpath.dirname(path) if not fs.isdir(path) else path
        base = _with_proto(proto, base)
        ds = ds.map_batches(normalise, batch_format="pyarrow", fn_kwargs={"cfg": cfg, "base_uri": base},
                            num_cpus=num_cpus, compute=task_pool(concurrency), zero_copy_batch=True)
    if inp.limit is not None:
        ds = ds.limit(inp.limit)
    return ds
