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

import math
import posixpath
from functools import cached_property

import pyarrow as pa
import ray

from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.operators.media.load import media_type_of
from vlbatch.operators.storage import arrow_filesystem, filesystem, open_input, with_retries
from vlbatch.operators.storage.options import protocol_of, with_protocol
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.keep import encode as encode_keep
from vlbatch.pipeline.keep import select as select_keep
from vlbatch.pipeline.sources.base import Source, limit, manifest_table, task_pool


def _resolve(uri, base: str) -> str | None:
    """Manifest-relative media paths -> absolute (same protocol as the manifest); null and ""
    stay as they are (not the manifest's folder, not '<folder>/None')."""
    if uri is None:
        return None
    uri = str(uri)
    if not uri.strip() or "://" in uri or uri.startswith("/"):
        return uri
    return posixpath.normpath(posixpath.join(base, uri))


def normalise(table: pa.Table, cfg: JobConfig, base_uri: str, *, file_uri: str | None = None,
              row_offset: int | None = None, keep: pa.Schema | None = None) -> pa.Table:
    """Any manifest block -> the manifest columns (`base.MANIFEST_SCHEMA`). `file_uri` and
    `row_offset` (the block's first row in that file) name embedded media that have no path
    (`<file>#<row>`); `keep`: the run's schema of `input.columns.keep`."""
    cols = cfg.input.columns
    if cols.media not in table.column_names:
        raise InputError(f"manifest has no column {cols.media!r} (input.columns.media); "
                         f"columns are: {', '.join(table.column_names)}")
    n = table.num_rows
    uris, data, identity = _media(table.column(cols.media), base_uri, file_uri, row_offset)
    mtype = [_cell(m) for m in table.column(cols.media_type).to_pylist()] \
        if cols.media_type in table.column_names else [None] * n
    mtype = [None if m is None else str(m) for m in mtype]
    if data is not None:  # embedded media: the type from the path's extension, else the bytes' signature
        mtype = [m if m is not None or b is None else media_type_of(u or "", b[:16])
                 for m, u, b in zip(mtype, uris, data, strict=True)]
    if cols.questions:
        if cols.questions not in table.column_names:
            raise InputError(f"manifest has no column {cols.questions!r} (input.columns.questions)")
        qs = [_questions(_cell(q)) for q in table.column(cols.questions).to_pylist()]
    else:
        qs = [None] * n
    extra = {} if data is None else {"media_bytes": data, "identity": identity}
    if keep is not None:
        extra["keep"] = encode_keep(select_keep(table, keep, f"manifest {file_uri or base_uri}"))
    return manifest_table(n, media_uri=uris, media_type=mtype, questions=qs, **extra)


def _holds_uris(t: pa.DataType) -> bool:
    """A media column of this type holds URIs (else embedded bytes: binary, or a struct of them)."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _media(col: pa.ChunkedArray, base_uri: str, file_uri: str | None,
           row_offset: int | None) -> tuple[list, list | None, list | None]:
    """(media URIs, embedded bytes or None, identities or None) of the media column: a string column of URIs, a
    binary column of bytes, or a struct of `bytes` and `path` (Hugging Face `datasets` Image /
    Video). Embedded media without a path are named `<file>#<row>`."""
    t = col.type
    if _holds_uris(t):
        return [_resolve(_cell(u), base_uri) for u in col.to_pylist()], None, None
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        data, paths = col.to_pylist(), [None] * len(col)
    elif pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        vals = col.to_pylist()
        data = [None if v is None else v["bytes"] for v in vals]
        paths = [None if v is None else v.get("path") for v in vals]
    else:
        raise InputError(f"media column of type {t}: expected strings (URIs), binary (bytes) or a struct "
                         "with `bytes` and `path` fields (Hugging Face datasets Image / Video)")
    if row_offset is None and any(b is not None and not p for b, p in zip(data, paths, strict=True)):
        raise InputError("embedded media without a path need a Parquet manifest (a row number names them)")
    where = file_uri or base_uri
    uris = [(p if b is not None else _resolve(p, base_uri)) if p else
            (None if b is None else f"{where}#{row_offset + i}")
            for i, (b, p) in enumerate(zip(data, paths, strict=True))]
    # identity: the row (`<file>#<row>`), not the path: exports often name every image alike
    ids = [None if b is None or row_offset is None else f"{where}#{row_offset + i}" for i, b in enumerate(data)]
    return uris, data, ids


def _cell(v):
    """A manifest value, with a missing one as None: JSON lines that lack a key can reach us as
    NaN (a float) when Ray Data's JSON reader goes through pandas."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _questions(q) -> list[str] | None:
    """A questions cell -> list of strings: a list, a JSON list in a string, one question as a
    string, or a scalar (one question); None when missing."""
    if q is None:
        return None
    if isinstance(q, str):
        return _json_list(q)
    if isinstance(q, (list, tuple)):
        return [str(x) for x in q]
    return [str(q)]


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

    def _retried(self, fn, what: str):
        return with_retries(fn, what=f"{what} {self.cfg.input.uri}", storage=self.cfg.storage.options())

    @cached_property
    def _parquet_files(self) -> list[str]:
        """A Parquet manifest's files, listed once per source (`read`, `count` and the first file's schema)."""
        inp = self.cfg.input
        fs, path = filesystem(inp.uri, self.cfg.storage.options())
        return parquet_files(fs, path, inp.uri, self._retried)

    def read(self, *, num_cpus: float | None = None, concurrency: int | None = None) -> ray.data.Dataset:
        cfg = self.cfg
        inp = cfg.input
        storage = cfg.storage.options()
        fs, path = filesystem(inp.uri, storage)
        retried = self._retried
        if not retried(lambda: fs.exists(path) or fs.glob(path), "listing"):
            raise ConfigError(f"input.uri: {inp.uri!r} does not exist")
        pafs = None if protocol_of(inp.uri) == "file" else arrow_filesystem(fs, storage)
        base = path if retried(lambda: fs.isdir(path), "listing") else posixpath.dirname(path)
        base = with_protocol(inp.uri, base)
        keep = self.keep_schema()
        if inp.format == "parquet":
            files = self._parquet_files
            return limit(ray.data.from_items([{"path": f} for f in files]).map_batches(
                _read_parquet_files, batch_format="pyarrow", batch_size=1, num_cpus=num_cpus,
                compute=task_pool(concurrency), fn_kwargs={"cfg": cfg, "base_uri": base, "keep": keep}), inp.limit)
        if inp.format == "jsonl":
            ds = ray.data.read_json(path, filesystem=pafs, lines=True, num_cpus=num_cpus,
                                    concurrency=concurrency)
        else:
            ds = ray.data.read_csv(path, filesystem=pafs, num_cpus=num_cpus, concurrency=concurrency)
        ds = ds.map_batches(normalise, batch_format="pyarrow", fn_kwargs={"cfg": cfg, "base_uri": base, "keep": keep},
                            num_cpus=num_cpus, compute=task_pool(concurrency), zero_copy_batch=True)
        return limit(ds, inp.limit)

    def embeds_media(self) -> bool:
        """Parquet: the first file's media column is binary or a struct (Hugging Face Image /
        Video); JSONL and CSV hold URIs."""
        inp = self.cfg.input
        if inp.format != "parquet":
            return False
        i = self._first_schema.get_field_index(inp.columns.media)
        return i >= 0 and not _holds_uris(self._first_schema.field(i).type)

    @cached_property
    def _first_file(self) -> str:
        """The first manifest file (sorted), the one whose schema stands for the input's."""
        inp = self.cfg.input
        if inp.format == "parquet":
            return self._parquet_files[0]
        fs, path = filesystem(inp.uri, self.cfg.storage.options())
        found = sorted(self._retried(lambda: fs.find(path) if fs.isdir(path) else fs.glob(path), "listing"))
        if not found:
            raise ConfigError(f"input.uri: {inp.uri!r} does not exist")
        return with_protocol(inp.uri, found[0])

    @cached_property
    def _first_schema(self) -> pa.Schema:
        """The first file's schema, read once per source (`keep_schema`, `embeds_media`)."""
        return _first_schema(self._first_file, self.cfg.input.format, self.cfg.storage.options())

    def keep_schema(self) -> pa.Schema | None:
        """The kept columns' types from the first manifest file: the Parquet schema, or the types
        pyarrow infers from the first block of a JSONL / CSV file."""
        names = self.cfg.input.columns.keep
        if not names:
            return None
        first, schema = self._first_file, self._first_schema
        missing = [n for n in names if n not in schema.names]
        if missing:
            raise ConfigError(f"input.columns.keep: {first} has no column {', '.join(map(repr, missing))}; "
                              f"columns are: {', '.join(schema.names)}")
        return pa.schema([schema.field(n) for n in names])

    def count(self) -> int | None:
        """Parquet: the rows in the files' footers (one small read per file, no row read); one local
        JSONL file up to `JSONL_COUNT_BYTES`: its non-blank lines; else None."""
        inp = self.cfg.input
        if inp.format == "jsonl":
            return self._count_jsonl()
        if inp.format != "parquet":
            return None
        import pyarrow.parquet as pq

        storage = self.cfg.storage.options()
        total = 0
        for uri in self._parquet_files:
            ffs, fpath = filesystem(uri, storage)
            with open_input(ffs, fpath, storage) as f:
                total += pq.ParquetFile(f).metadata.num_rows
            if inp.limit is not None and total >= inp.limit:
                return inp.limit
        return total

    def _count_jsonl(self) -> int | None:
        """The non-blank lines of a local JSONL manifest that is one file of at most
        `JSONL_COUNT_BYTES` (a folder, a glob or a remote file: None, counted as read)."""
        inp = self.cfg.input
        if protocol_of(inp.uri) != "file":
            return None
        fs, path = filesystem(inp.uri, self.cfg.storage.options())
        if not fs.isfile(path) or fs.size(path) > JSONL_COUNT_BYTES:
            return None
        with fs.open(path, "rb") as f:
            n = sum(1 for line in f if line.strip())
        return n if inp.limit is None else min(n, inp.limit)


JSONL_COUNT_BYTES = 64 << 20  # a JSONL manifest counted in the driver before the run (~0.1 s per 64 MiB)


def _first_schema(uri: str, fmt: str, storage) -> pa.Schema:
    fs, path = filesystem(uri, storage)
    with open_input(fs, path, storage) as f:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(f).schema_arrow
        if fmt == "jsonl":
            import pyarrow.json as pj

            return pj.open_json(f).schema
        import pyarrow.csv as pcsv

        return pcsv.open_csv(f).schema


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


def _read_parquet_files(batch: pa.Table, *, cfg: JobConfig, base_uri: str, keep: pa.Schema | None = None):
    """A batch of file URIs -> normalised manifest blocks, one per row group (bounded memory)."""
    import pyarrow.parquet as pq

    storage = cfg.storage.options()
    for uri in batch.column("path").to_pylist():
        fs, path = filesystem(uri, storage)
        with open_input(fs, path, storage) as f:
            pf = pq.ParquetFile(f)
            offset = 0
            for i in range(pf.num_row_groups):
                group = pf.read_row_group(i)
                yield normalise(group, cfg, base_uri, file_uri=uri, row_offset=offset, keep=keep)
                offset += group.num_rows
