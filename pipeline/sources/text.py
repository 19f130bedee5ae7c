"""JSONL and CSV manifests, read line by line through the one storage layer.

Ray Data's `read_json` refuses a filesystem with `lines=True` (every remote JSONL manifest
failed), and its readers fail a whole file on one bad line. Here the driver lists the files
(`text_files`) and function tasks read them (`read_text_files`): http(s):// as one streamed GET
(`storage.http_stream.open_http`, redirects checked there), local / s3:// as `open_input` streams
(ranged reads, each retried); `.gz` files are decompressed. Each file gives blocks of at most
`BLOCK_LINES` rows in file order (bounded memory), normalised by `manifest.normalise`.

One bad line is one `InputError` row, never a failed job: its `identity` is
`<file>#L<line>` (the request ids hash it; line numbers count from 1), `media_uri` null, the
message names the file, the line and what is wrong: a missing, null or empty media (each
line its own row, never one id for all of them), not UTF-8, not JSON, JSON that is not an
object (an array, a number), a cell of the wrong type, a lone surrogate (`\\ud800` escapes are
refused, never dropped or replaced), a line over `MAX_LINE_BYTES`. Blank lines are skipped.
CSV: the first row names the columns; an empty questions cell is a missing one (CSV has no null).
"""
from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from vlbatch.operators.errors import InputError
from vlbatch.operators.storage import filesystem, open_input
from vlbatch.operators.storage.http import is_http
from vlbatch.operators.storage.http_stream import open_http
from vlbatch.pipeline.sources.base import manifest_table
from vlbatch.pipeline.sources.cells import cell, check_text, questions

BLOCK_LINES = 4096  # manifest rows per block
MAX_LINE_BYTES = 16 << 20  # a longer line is an error row (and is skipped, not held in memory)
EXTENSIONS = {"jsonl": (".jsonl", ".json", ".ndjson"), "csv": (".csv", ".tsv")}


@dataclass(frozen=True)
class Line:
    """One manifest row: `values` (column -> cell) or `error` (why the line is no row), `number` from 1."""

    number: int
    values: dict | None = None
    error: str | None = None


def is_text_file(name: str, fmt: str) -> bool:
    """Whether a file found in a manifest folder belongs to the manifest (`_` / `.` names skipped)."""
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(("_", ".")) and base.removesuffix(".gz").endswith(EXTENSIONS[fmt])


def _open(uri: str, storage):
    if is_http(uri):
        stream = open_http(uri, storage)
    else:
        fs, path = filesystem(uri, storage)
        stream = open_input(fs, path, storage)
    return gzip.GzipFile(fileobj=stream) if uri.split("?", 1)[0].endswith(".gz") else stream


def _raw_lines(f) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes without the newline, or None when over MAX_LINE_BYTES) of a binary stream."""
    n = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        n += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # skip the rest of the line, a bounded piece at a time
                raw = f.readline(MAX_LINE_BYTES)
            yield n, None
            continue
        yield n, raw.rstrip(b"\r\n")


def jsonl_lines(f) -> Iterator[Line]:
    for n, raw in _raw_lines(f):
        if raw is None:
            yield Line(n, error=f"longer than {MAX_LINE_BYTES} bytes")
        elif raw.strip():
            yield _json_line(n, raw)


def _json_line(n: int, raw: bytes) -> Line:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Line(n, error=f"not valid UTF-8 (byte {e.start + 1} of the line)")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return Line(n, error=f"not JSON ({getattr(e, 'msg', 'nested too deeply')})")
    if not isinstance(obj, dict):
        return Line(n, error=f"a JSON {type(obj).__name__.replace('dict', 'object').replace('list', 'array')}, "
                             "not an object (one object per line)")
    return Line(n, obj)


def csv_lines(f, delimiter: str = ",") -> Iterator[Line]:
    """CSV records (a quoted cell may span lines: a record's number is its first line). Bytes that
    are not UTF-8 come through as lone surrogates (`surrogateescape`), which `check_text` refuses."""
    text = io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape", newline="")
    reader = csv.reader(text, delimiter=delimiter)
    start = 1
    header = None
    while True:
        try:
            rec = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            yield Line(start, error=f"not CSV ({e})")
            start = reader.line_num + 1
            continue
        n, start = start, reader.line_num + 1
        if header is None:
            header = rec
            try:
                check_text(header, "the header row")
            except InputError as e:
                raise InputError(f"{e} (line 1)") from None
            continue
        if rec and any(c.strip() for c in rec):
            yield Line(n, dict(zip(header, rec, strict=False)))


@dataclass(frozen=True)
class _Columns:
    media: str
    media_type: str | None
    questions: str | None
    keep: pa.Schema | None


def _row(line: Line, cols: _Columns, fmt: str) -> tuple:
    """(media, media_type, questions, keep values) of a good line; `InputError` for a bad cell."""
    v = line.values
    media, mtype = cell(v.get(cols.media)), cell(v.get(cols.media_type)) if cols.media_type else None
    if media is None or (isinstance(media, str) and not media.strip()):  # its own row, named by its line
        what = "missing" if cols.media not in v else "null" if media is None else "empty"
        raise InputError(f"column {cols.media!r} is {what} (input.columns.media)")
    if not isinstance(media, str):
        raise InputError(f"column {cols.media!r} is a {type(media).__name__}, not a string (a media URI)")
    if mtype is not None and not isinstance(mtype, str):
        raise InputError(f"column {cols.media_type!r} is a {type(mtype).__name__}, not a string")
    q = v.get(cols.questions) if cols.questions else None
    if fmt == "csv" and isinstance(q, str) and not q.strip():
        q = None  # an empty CSV cell: no questions given (task.questions apply)
    qs = questions(q)
    check_text(media, f"column {cols.media!r}")
    check_text(mtype, f"column {cols.media_type!r}")
    check_text(qs, f"column {cols.questions!r}")
    keep = tuple(cell(v.get(n)) for n in (cols.keep.names if cols.keep is not None else ()))
    for name, x in zip(cols.keep.names if cols.keep is not None else (), keep, strict=True):
        check_text(x if isinstance(x, (str, list)) else None, f"column {name!r}")
    return media, mtype, qs, keep


def _keep_columns(good: list[tuple[int, tuple]], keep: pa.Schema, fmt: str) -> tuple[dict, set[int]]:
    """The kept columns of the good rows, cast to the run's `keep` schema: ({name: array}, indices of
    rows whose values do not fit it). CSV cells are text, cast to the type; JSON values are converted."""
    def convert(values, typ):
        if fmt == "csv":
            return pa.array([None if v == "" and not pa.types.is_string(typ) else v for v in values],
                            pa.string()).cast(typ)
        return pa.array(values, typ)

    bad: set[int] = set()
    for j, f in enumerate(keep):
        try:
            convert([r[3][j] for _, r in good], f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError, OverflowError):
            for i, (_, r) in enumerate(good):  # find the rows at fault, one by one
                try:
                    convert([r[3][j]], f.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError,
                        OverflowError):
                    bad.add(i)
    rows = [r for i, (_, r) in enumerate(good) if i not in bad]
    return {f.name: convert([r[3][j] for r in rows], f.type) for j, f in enumerate(keep)}, bad


def block(lines: list[Line], cfg, base_uri: str, file_uri: str, keep: pa.Schema | None) -> pa.Table:
    """Lines of one file -> one manifest block (`base.MANIFEST_SCHEMA`), in line order; a bad line
    is an error row (module docstring)."""
    from vlbatch.pipeline.sources.cells import normalise

    c = cfg.input.columns
    cols = _Columns(c.media, c.media_type, c.questions, keep)
    good, bad, blank = [], [], {}  # blank: line -> an empty media value, kept as the manifest has it ("" stays "")
    for ln in lines:
        if ln.error is not None:
            bad.append((ln.number, ln.error))
            continue
        try:
            good.append((ln.number, _row(ln, cols, cfg.input.format)))
        except InputError as e:
            bad.append((ln.number, str(e)))
            m = ln.values.get(c.media)
            blank[ln.number] = m if isinstance(m, str) and not m.strip() else None
    kept = None
    if keep is not None and good:
        kept, misfits = _keep_columns(good, keep, cfg.input.format)
        bad += [(good[i][0], f"a column of input.columns.keep does not fit its type ({keep})") for i in sorted(misfits)]
        good = [g for i, g in enumerate(good) if i not in misfits]
    table = {c.media: pa.array([r[0] for _, r in good], pa.string())}
    if c.media_type:
        table[c.media_type] = pa.array([r[1] for _, r in good], pa.string())
    if c.questions:
        table[c.questions] = pa.array([r[2] for _, r in good], pa.list_(pa.string()))
    for name, arr in (kept or {}).items():
        table.setdefault(name, arr)
    if keep is not None and not good:
        table.update({f.name: pa.array([], f.type) for f in keep if f.name not in table})
    out = normalise(pa.table(table), cfg, base_uri, keep=keep)
    if bad:
        errors = manifest_table(len(bad), media_uri=[blank.get(n) for n, _ in bad],
                                identity=[f"{file_uri}#L{n}" for n, _ in bad],
                                error=[f"manifest {file_uri} line {n}: {msg}" for n, msg in bad])
        order = sorted(range(len(good) + len(bad)),
                       key=lambda i: good[i][0] if i < len(good) else bad[i - len(good)][0])
        out = pa.concat_tables([out, errors]).take(pa.array(order, pa.int64()))
    return out


SAMPLE_LINES = 1000  # lines of the first file whose good rows give the kept columns' types (`sample_schema`)


def sample_schema(uri: str, fmt: str, storage) -> pa.Schema:
    """The columns of a JSONL / CSV manifest file and their types, as pyarrow's reader infers them,
    from the good rows among its first `SAMPLE_LINES` lines: a bad line is an error row when it is
    read, never a failed job here (pyarrow's readers fail on one). JSONL values whose types clash
    across lines: the first non-null value's type (the others become error rows as they are read)."""
    with _open(uri, storage) as f:
        if fmt == "jsonl":
            rows = [ln.values for ln in itertools.islice(jsonl_lines(f), SAMPLE_LINES) if ln.error is None]
            return _json_schema(rows)
        good = [ln.values for ln in itertools.islice(csv_lines(f, _delimiter(uri)), SAMPLE_LINES)
                if ln.error is None and _utf8(ln.values)]
    import pyarrow.csv as pcsv

    buf = io.StringIO()  # the good rows as one clean CSV (each row's cells are a prefix of the header)
    w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in good for k in r)))
    w.writeheader()
    w.writerows(good)
    return pcsv.read_csv(io.BytesIO(buf.getvalue().encode())).schema


def _utf8(values: dict) -> bool:
    try:
        check_text(list(values.values()), "a cell")
    except InputError:
        return False
    return True


def _arrow_reads(row: dict) -> bool:
    """Whether pyarrow's JSON reader takes this one row (Python's json takes a lone surrogate, "\\ud800";
    pyarrow does not: such a line is an error row when read, and no part of the schema)."""
    import pyarrow.json as pj

    try:
        pj.read_json(io.BytesIO((json.dumps(row) + "\n").encode()))
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return False
    return True


def _json_schema(rows: list[dict]) -> pa.Schema:
    import pyarrow.json as pj

    try:
        return pj.read_json(io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())).schema
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        rows = [r for r in rows if _arrow_reads(r)]
    names = list(dict.fromkeys(k for r in rows for k in r))
    fields = []
    for n in names:  # a clash: column by column, the first non-null value's type where the column clashes
        values = [r[n] for r in rows if n in r]
        try:
            typ = pj.read_json(io.BytesIO("".join(json.dumps({n: v}) + "\n" for v in values).encode())).schema[0].type
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            first = next(v for v in values if v is not None)
            typ = pj.read_json(io.BytesIO(json.dumps({n: first}).encode())).schema[0].type
        fields.append(pa.field(n, typ))
    return pa.schema(fields)


def _delimiter(uri: str) -> str:
    return "\t" if uri.split("?", 1)[0].removesuffix(".gz").endswith(".tsv") else ","


def read_text_files(batch: pa.Table, *, cfg, base_uri: str, keep: pa.Schema | None = None) -> Iterator[pa.Table]:
    """A batch of file URIs (column `path`) -> manifest blocks of at most `BLOCK_LINES` rows each."""
    storage = cfg.storage.options()
    for uri in batch.column("path").to_pylist():
        with _open(uri, storage) as f:
            if cfg.input.format == "jsonl":
                lines = jsonl_lines(f)
            else:
                lines = csv_lines(f, _delimiter(uri))
            chunk: list[Line] = []
            for ln in lines:
                chunk.append(ln)
                if len(chunk) == BLOCK_LINES:
                    yield block(chunk, cfg, base_uri, uri, keep)
                    chunk = []
            if chunk:
                yield block(chunk, cfg, base_uri, uri, keep)
