"""`input.format: parquet | jsonl | csv`: a manifest of media URIs (the `Source` contract: `base.py`).

Local paths and s3:// are read through the one storage layer (`vlbatch.operators.storage`:
s3fs with the job's storage options; for Ray Data's readers a pyarrow filesystem whose calls
follow the one retry policy). Parquet manifests are not read by Ray Data's `read_parquet`,
whose set-up samples files with 1-CPU tasks (and lists many files with 1-CPU tasks): beside
actor pools that hold all but a fraction of a CPU those never start and the run hangs.
Instead the driver lists the files (no task), and function tasks of `num_cpus` each read
them row group by row group (`_read_parquet_files`). The result is a dataset with exactly three
columns, whatever the source: `media_uri` (string), `media_type` (string or null),
`questions` (list<string> or null). Relative media paths in a manifest are resolved
against the manifest's folder; a null or empty `media_uri` is kept as it is (null / ""),
and expansion turns it into an `InputError` row.
"""
from __future__ import annotations

import posixpath

import pyarrow as pa
import ray

from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.operators.storage import arrow_filesystem, filesystem, open_input, with_retries
from vlbatch.operators.storage.options import protocol_of, with_protocol
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.sources.base import Source, limit, task_pool


def _resolve(uri, base: str) -> str | None:
    """Manifest-relative media paths -> absolute (same protocol as the manifest); null and ""
    stay as they are (not the manifest's folder, not '<folder>/None')."""
    if uri is None:
        return None
    uri = str(uri)
    if not uri.strip() or "://" in uri or uri.startswith("/"):
        return uri
    return posixpath.normpath(posixpath.join(base, uri))


def normalise(table: pa.Table, cfg: JobConfig, base_uri: str) -> pa.Table:
    """Any manifest block -> (media_uri, media_type, questions)."""
    cols = cfg.input.columns
    if cols.media not in table.column_names:
        raise InputError(f"manifest has no column {cols.media!r} (input.columns.media); "
                         f"columns are: {', '.join(table.column_names)}")
    uris = [_resolve(u, base_uri) for u in table.column(cols.media).to_pylist()]
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


class ManifestSource(Source):
    """Parquet (listed in the driver, read row group by row group in our tasks), JSONL and CSV
    (Ray Data's readers through the one storage layer), normalised to the manifest columns."""

    def read(self, *, num_cpus: float | None = None, concurrency: int | None = None) -> ray.data.Dataset:
        cfg = self.cfg
        inp = cfg.input
        storage = cfg.storage.options()
        fs, path = filesystem(inp.uri, storage)

        def retried(fn, what: str):
            return with_retries(fn, what=f"{what} {inp.uri}", storage=storage)

        if not retried(lambda: fs.exists(path) or fs.glob(path), "listing"):
            raise ConfigError(f"input.uri: {inp.uri!r} does not exist")
        pafs = None if protocol_of(inp.uri) == "file" else arrow_filesystem(fs, storage)
        base = path if retried(lambda: fs.isdir(path), "listing") else posixpath.dirname(path)
        base = with_protocol(inp.uri, base)
        if inp.format == "parquet":
            files = parquet_files(fs, path, inp.uri, retried)
            return limit(ray.data.from_items([{"path": f} for f in files]).map_batches(
                _read_parquet_files, batch_format="pyarrow", batch_size=1, num_cpus=num_cpus,
                compute=task_pool(concurrency), fn_kwargs={"cfg": cfg, "base_uri": base}), inp.limit)
        if inp.format == "jsonl":
            ds = ray.data.read_json(path, filesystem=pafs, lines=True, num_cpus=num_cpus,
                                    concurrency=concurrency)
        else:
            ds = ray.data.read_csv(path, filesystem=pafs, num_cpus=num_cpus, concurrency=concurrency)
        ds = ds.map_batches(normalise, batch_format="pyarrow", fn_kwargs={"cfg": cfg, "base_uri": base},
                            num_cpus=num_cpus, compute=task_pool(concurrency), zero_copy_batch=True)
        return limit(ds, inp.limit)


    def count(self) -> int | None:
        """Parquet: the rows in the files' footers (one small read per file, no row read); else None."""
        inp = self.cfg.input
        if inp.format != "parquet":
            return None
        import pyarrow.parquet as pq

        storage = self.cfg.storage.options()
        fs, path = filesystem(inp.uri, storage)

        def retried(fn, what: str):
            return with_retries(fn, what=f"{what} {inp.uri}", storage=storage)

        total = 0
        for uri in parquet_files(fs, path, inp.uri, retried):
            ffs, fpath = filesystem(uri, storage)
            with open_input(ffs, fpath, storage) as f:
                total += pq.ParquetFile(f).metadata.num_rows
            if inp.limit is not None and total >= inp.limit:
                return inp.limit
        return total


def parquet_files(fs, path: str, uri: str, retried) -> list[str]:
    """The Parquet files of a manifest (URIs, sorted), listed here in the driver: `path`
    itself, the `*.parquet` files under a folder (names starting with '_' or '.' skipped, as
    Ray Data skips them) or the matches of a glob."""
    if retried(lambda: fs.isdir(path), "listing"):
        found = retried(lambda: fs.find(path), "listing")
    elif any(c in path for c in "*?["):
        found = retried(lambda: fs.glob(path), "listing")
    else:
        return [with_protocol(uri, path)]
    files = sorted(f for f in found if f.endswith(".parquet") and not f.rsplit("/", 1)[-1].startswith(("_", ".")))
    if not files:
        raise ConfigError(f"input.uri: no .parquet files in {uri!r}")
    return [with_protocol(uri, f) for f in files]


def _read_parquet_files(batch: pa.Table, *, cfg: JobConfig, base_uri: str):
    """A batch of file URIs -> normalised manifest blocks, one per row group (bounded memory)."""
    import pyarrow.parquet as pq

    storage = cfg.storage.options()
    for uri in batch.column("path").to_pylist():
        fs, path = filesystem(uri, storage)
        with open_input(fs, path, storage) as f:
            pf = pq.ParquetFile(f)
            for i in range(pf.num_row_groups):
                yield normalise(pf.read_row_group(i), cfg, base_uri)
