"""`input.format: parquet | jsonl | csv`: a manifest of media URIs (the `Source` contract: `base.py`).

Every manifest is read through the one storage layer (`vlbatch.operators.storage`: local
paths, s3:// with the job's storage options, http(s):// with `storage.http`), never by Ray
Data's readers: its `read_parquet` samples files with 1-CPU tasks (beside actor pools that
hold all but a fraction of a CPU those never start and the run hangs), its `read_json`
refuses a filesystem with `lines=True`, and both fail a whole file on one bad line. The
driver lists the files (no task); function tasks of `num_cpus` each read them: Parquet row
group by row group (`_read_parquet_files`), JSONL / CSV line by line (`text.py`: a bad line
is one `InputError` row). Blocks are normalised (`cells.normalise`) to the manifest columns
(`base.MANIFEST_SCHEMA`). Relative media paths resolve against the manifest's folder with
its scheme (`cells.resolve`: a remote manifest's never become local paths, nor climb out of
its bucket / host); a null or empty `media_uri` is kept as it is (null / ""), and expansion
turns it into an `InputError` row.
"""
from __future__ import annotations

import io
import posixpath
from collections.abc import Iterator
from functools import cached_property

import pyarrow as pa
import ray

from vlbatch.operators.errors import ConfigError, InputError, MediaError, StorageError
from vlbatch.operators.storage import filesystem, open_input, with_retries
from vlbatch.operators.storage.http import is_http, read_http
from vlbatch.operators.storage.http_stream import open_http
from vlbatch.operators.storage.options import protocol_of, with_protocol
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.sources.base import Source
from vlbatch.pipeline.sources.cells import _holds_uris, normalise
from vlbatch.pipeline.sources.text import is_text_file, read_text_files, sample_schema

__all__ = ["ManifestSource", "normalise", "parquet_files"]


class ManifestSource(Source):
    """Parquet, JSONL and CSV manifests (module docstring), normalised to the manifest columns."""

    def _retried(self, fn, what: str):
        return with_retries(fn, what=f"{what} {self.cfg.input.uri}", storage=self.storage)

    @cached_property
    def _parquet_files(self) -> list[str]:
        """A Parquet manifest's files, listed once per source (`read`, `count` and the first file's schema)."""
        inp = self.cfg.input
        if is_http(inp.uri):
            return [inp.uri]
        fs, path = filesystem(inp.uri, self.storage)
        return parquet_files(fs, path, inp.uri, self._retried)

    def _check_exists(self) -> None:
        """`ConfigError` naming input.uri when nothing is there (http(s): one GET opened and closed,
        so a refused redirect says so, not "does not exist")."""
        inp, storage = self.cfg.input, self.storage
        if is_http(inp.uri):
            try:
                open_http(inp.uri, storage).close()
            except (MediaError, StorageError) as e:
                raise ConfigError(f"input.uri: {e}") from None
            return
        fs, path = filesystem(inp.uri, storage)
        if not self._retried(lambda: fs.exists(path) or fs.glob(path), "listing"):
            raise ConfigError(f"input.uri: {inp.uri!r} does not exist")

    @cached_property
    def _base(self) -> str:
        """The folder URI that relative media paths resolve against (the input folder, or the manifest's)."""
        inp = self.cfg.input
        if is_http(inp.uri):
            return inp.uri.split("?", 1)[0].split("#", 1)[0].rsplit("/", 1)[0]
        fs, path = filesystem(inp.uri, self.storage)
        base = path if self._retried(lambda: fs.isdir(path), "listing") else posixpath.dirname(path)
        return with_protocol(inp.uri, base)

    def read(self, *, num_cpus: float | None = None, concurrency: int | None = None) -> ray.data.Dataset:
        cfg = self.cfg
        inp = cfg.input
        self._check_exists()
        keep = self.keep_schema()
        files = self._parquet_files if inp.format == "parquet" else self._text_files
        fn = _read_parquet_files if inp.format == "parquet" else read_text_files
        items = [{"path": f} for f in files]  # one block per file: one read task each, at most `concurrency` at once
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            fn, batch_format="pyarrow", batch_size=1, num_cpus=num_cpus,
            compute=ray.data.TaskPoolStrategy(size=concurrency),  # at most `concurrency` tasks (None: Ray's choice)
            fn_kwargs={"cfg": cfg, "base_uri": self._base, "keep": keep})
        return ds if inp.limit is None else ds.limit(inp.limit)

    def driver_blocks(self) -> Iterator[pa.Table] | None:
        """A local manifest of URIs: the blocks `read`'s tasks make, read here by the same functions; a remote
        manifest or one of embedded media bytes: None (a second read of the input)."""
        inp = self.cfg.input
        if protocol_of(inp.uri) != "file" or self.embeds_media():
            return None
        self._check_exists()
        files = self._parquet_files if inp.format == "parquet" else self._text_files
        fn = _read_parquet_files if inp.format == "parquet" else read_text_files
        return fn(pa.table({"path": files}), cfg=self.cfg, base_uri=self._base, keep=self.keep_schema())

    @cached_property
    def _text_files(self) -> list[str]:
        """A JSONL / CSV manifest's files (URIs, sorted), listed in the driver: the file itself, the
        manifest files in a folder (`text.is_text_file`) or a glob's matches; http(s): the URL."""
        inp = self.cfg.input
        if is_http(inp.uri):
            return [inp.uri]
        fs, path = filesystem(inp.uri, self.storage)
        if self._retried(lambda: fs.isdir(path), "listing"):
            found = [f for f in self._retried(lambda: fs.find(path), "listing") if is_text_file(f, inp.format)]
        elif any(c in path for c in "*?["):
            found = self._retried(lambda: fs.glob(path), "listing")
        else:
            return [inp.uri if protocol_of(inp.uri) != "file" else path]
        if not found:
            raise ConfigError(f"input.uri: no {inp.format} files in {inp.uri!r}")
        return [with_protocol(inp.uri, f) for f in sorted(found)]

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
        return self._parquet_files[0] if inp.format == "parquet" else self._text_files[0]

    @cached_property
    def _first_schema(self) -> pa.Schema:
        """The first file's schema, read once per source (`keep_schema`, `embeds_media`)."""
        return _first_schema(self._first_file, self.cfg.input.format, self.storage)

    def keep_schema(self) -> pa.Schema | None:
        """The kept columns' types from the first manifest file: the Parquet schema, or the types
        pyarrow infers from the good lines of a JSONL / CSV file's first `text.SAMPLE_LINES`."""
        names = self.cfg.input.columns.keep
        if not names:
            return None
        first, schema = self._first_file, self._first_schema
        missing = [n for n in names if n not in schema.names]
        if missing:
            raise ConfigError(f"input.columns.keep: {first} has no column {', '.join(map(repr, missing))}; "
                              f"columns are: {', '.join(schema.names)}")
        return pa.schema([schema.field(n) for n in names])

    def check(self) -> None:
        """The input exists, and the first file's schema (`_first_schema`: a Parquet footer, a JSONL / CSV
        file's first `text.SAMPLE_LINES` lines) has every configured column: the media, questions and keep
        columns, and an explicitly configured media_type one (the default may be absent: inferred from
        the extension). A text file with no good line among those gives nothing to check against."""
        self._check_exists()
        try:
            schema, c = self._first_schema, self.cfg.input.columns
        except (InputError, pa.ArrowInvalid) as e:  # a CSV header that is not UTF-8, a file that is not Parquet
            raise ConfigError(f"input.uri: {self._first_file} cannot be read as {self.cfg.input.format}: {e}") from None
        if not schema.names:
            return
        wanted = {"media": [c.media], "questions": [c.questions] if c.questions else [], "keep": list(c.keep),
                  "media_type": [c.media_type] if c.media_type and "media_type" in c.model_fields_set else []}
        problems = [f"input.columns.{field}: {self._first_file} has no column {', '.join(map(repr, missing))}; "
                    f"columns are: {', '.join(schema.names)}"
                    for field, names in wanted.items() if (missing := [n for n in names if n not in schema.names])]
        if problems:
            raise ConfigError(problems[0] if len(problems) == 1 else "\n  ".join(["invalid input columns:", *problems]))

    def counted_by(self) -> str:
        return "parquet metadata" if self.cfg.input.format == "parquet" else f"{self.cfg.input.format} lines counted"

    def count(self) -> int | None:
        """Parquet: the rows in the files' footers (one small read per file, no row read); one local
        JSONL file up to `JSONL_COUNT_BYTES`: its non-blank lines; else None."""
        inp = self.cfg.input
        if inp.format == "jsonl":
            return self._count_jsonl()
        if inp.format != "parquet":
            return None
        import pyarrow.parquet as pq

        storage = self.storage
        total = 0
        for uri in self._parquet_files:
            with _open_file(uri, storage) as f:
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
        fs, path = filesystem(inp.uri, self.storage)
        if not fs.isfile(path) or fs.size(path) > JSONL_COUNT_BYTES:
            return None
        with fs.open(path, "rb") as f:
            n = sum(1 for line in f if line.strip())
        return n if inp.limit is None else min(n, inp.limit)


JSONL_COUNT_BYTES = 64 << 20  # a JSONL manifest counted in the driver before the run (~0.1 s per 64 MiB)


def _open_file(uri: str, storage):
    """A seekable stream of one manifest file: ranged, retried reads (`open_input`); http(s): the
    whole body read once (`read_http`: many servers answer a Range request with the whole file)."""
    if is_http(uri):
        return io.BytesIO(read_http(uri, storage))
    fs, path = filesystem(uri, storage)
    return open_input(fs, path, storage)


def _first_schema(uri: str, fmt: str, storage) -> pa.Schema:
    """The first file's schema: Parquet's footer; JSONL / CSV: inferred from its good lines
    (`text.sample_schema`: a bad line never fails the job here)."""
    if fmt != "parquet":
        return sample_schema(uri, fmt, storage)
    import pyarrow.parquet as pq

    with _open_file(uri, storage) as f:
        return pq.ParquetFile(f).schema_arrow


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
        with _open_file(uri, storage) as f:
            pf = pq.ParquetFile(f)
            offset = 0
            for i in range(pf.num_row_groups):
                group = pf.read_row_group(i)
                yield normalise(group, cfg, base_uri, file_uri=uri, row_offset=offset, keep=keep)
                offset += group.num_rows
