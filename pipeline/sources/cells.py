"""Manifest cells -> the manifest columns (`normalise`: a block; the helpers: one cell), with per-row errors.

Shared by the Arrow-read manifests (Parquet: `manifest.py`) and the line-read ones
(JSONL / CSV: `text.py`). A value that cannot be used raises `InputError`; the callers turn it
into that row's `error` (an `InputError` row), never a failed block.

- `resolve(uri, base)`: a manifest-relative media path against the manifest's folder URI. A
  local manifest: a local path (`..` allowed, as in any local path). A remote manifest
  (`s3://bucket/prefix`, `http(s)://host/path`): the same scheme and bucket / host, the path
  normalised there; `..` past the bucket's or host's root is refused, and nothing becomes a
  local path (a leading '/' is the bucket's / host's root, as in a URL). A full URI in a remote
  manifest names media of the manifest's own storage (s3 / s3a; http / https) or a scheme of
  `storage.allow_schemes`: never a local file unless `file` is allowed. Local paths and web URLs
  lose their `.` / `..` segments (`./a.png` and `a.png` are one media, one id).
- `questions(cell)`: a questions cell -> list of strings (a list, a JSON list in a string, one
  question as a string, or a scalar), None when missing.
- `check_text(value, what)`: every string in `value` is valid Unicode (a lone surrogate from
  a JSON `\\ud800` escape, or undecodable bytes read with `surrogateescape`, is refused, never
  changed).
"""
from __future__ import annotations

import json
import math
import posixpath

import pyarrow as pa

from vlbatch.operators.errors import InputError
from vlbatch.operators.media.load import media_type_of
from vlbatch.pipeline.sources.base import manifest_table
from vlbatch.pipeline.sources.keep import encode as encode_keep
from vlbatch.pipeline.sources.keep import select as select_keep

LOCAL = ("file", "local")


def cell(v):
    """A manifest value, with a missing one as None (NaN from a pandas-backed reader too)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def split_base(base: str) -> tuple[str, str, str]:
    """(scheme, root, path) of a folder URI: 's3://b/ds/imgs' -> ('s3', 's3://b', 'ds/imgs');
    a local folder -> ('file', '', '/its/path'). Query and fragment of an http URL are dropped."""
    if "://" not in base:
        return "file", "", base
    scheme, rest = base.split("://", 1)
    if scheme.lower() in LOCAL:
        return "file", "", "/" + rest.lstrip("/")
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    netloc, _, path = rest.partition("/")
    return scheme.lower(), f"{scheme}://{netloc}", path.strip("/")


FAMILIES = {"file": "file", "local": "file", "s3": "s3", "s3a": "s3", "http": "http", "https": "http"}


def _family(scheme: str) -> str:
    """The kind of storage a scheme reaches: local files, S3, the web (http and https); else itself."""
    return FAMILIES.get(scheme.lower(), scheme.lower())


def resolve(uri, base: str, allow: tuple[str, ...] = ()) -> str | None:
    """Manifest-relative media path -> absolute (module docstring); null and "" stay as they are.
    A full URI in a remote manifest must be of the manifest's kind of storage (`_family`) or a
    scheme of `allow` (`storage.allow_schemes`), else `InputError`: a remote manifest never names a
    local file. Local paths and http(s) URLs are normalised (`.` / `..` segments): one media, one id."""
    if uri is None:
        return None
    uri = str(uri)
    if not uri.strip():
        return uri
    scheme, root, path = split_base(base)
    if "://" in uri:
        return _full_uri(uri, scheme, root, allow)
    if scheme == "file":
        return posixpath.normpath(uri if uri.startswith("/") else posixpath.join(path, uri))
    rel = uri.lstrip("/") if uri.startswith("/") else posixpath.join(path, uri)
    norm = posixpath.normpath(rel) if rel else ""
    if norm == ".." or norm.startswith("../"):
        raise InputError(f"media path {uri!r} climbs above {root}/ (the manifest's bucket or host): "
                         "a relative path stays inside it; give a full URI to read elsewhere")
    return f"{root}/{'' if norm == '.' else norm}"


def _full_uri(uri: str, base_scheme: str, root: str, allow: tuple[str, ...]) -> str:
    """A full media URI of a manifest whose folder has `base_scheme` (the rule: `resolve`), normalised
    where that names the same media: a local path's and a web URL's dot segments (an S3 key is
    opaque: 's3://b/./a' is its own key)."""
    scheme, rest = uri.split("://", 1)
    fam = _family(scheme)
    if base_scheme != "file" and fam != _family(base_scheme) and scheme.lower() not in allow:
        where = "a local file" if fam == "file" else f"{scheme}:// media"
        raise InputError(f"media {uri!r}: a remote manifest ({root}/) may name only media of its own storage "
                         f"({base_scheme}://), not {where}; storage.allow_schemes: [{scheme.lower()}] allows it")
    if fam == "file":
        return f"{scheme}://{_dot_free(rest)}" if rest.startswith("/") else uri
    if fam == "http" and "/" in rest:
        netloc, _, tail = rest.partition("/")
        path, sep, query = _split_query(tail)
        return f"{scheme}://{netloc}{_dot_free('/' + path)}{sep}{query}"
    return uri


def _dot_free(path: str) -> str:
    """`path` without `.` / `..` segments, a trailing '/' kept (only when it has such segments:
    every other path, ids included, stays byte for byte)."""
    parts = path.split("/")
    if "." not in parts and ".." not in parts:
        return path
    norm = posixpath.normpath(path)
    return norm + "/" if path.endswith("/") and norm != "/" else norm


def _split_query(tail: str) -> tuple[str, str, str]:
    """('a/b', '?', 'x=1#f') of 'a/b?x=1#f': the path, then the query / fragment as they were."""
    cut = min((i for i in (tail.find("?"), tail.find("#")) if i >= 0), default=len(tail))
    return tail[:cut], tail[cut:cut + 1], tail[cut + 1:]


def questions(q) -> list[str] | None:
    """A questions cell -> list of strings; None when missing (`task.questions` then apply)."""
    q = cell(q)
    if q is None:
        return None
    if isinstance(q, str):
        return _json_list(q)
    if isinstance(q, (list, tuple)):
        return ["" if x is None else str(x) for x in q]  # a null question is an empty one: its own error row
    return [str(q)]


def _json_list(s: str) -> list[str]:
    try:
        v = json.loads(s)
    except (json.JSONDecodeError, RecursionError):
        return [s]
    return ["" if x is None else str(x) for x in v] if isinstance(v, list) else [str(v)]


def check_text(value, what: str) -> None:
    """`InputError` naming `what` when a string in `value` (a str or a list of them) is not valid Unicode."""
    for s in (value if isinstance(value, (list, tuple)) else [value]):
        if isinstance(s, str) and not s.isascii():  # ASCII is valid UTF-8: the common case, no copy
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = s[e.start]
                raise InputError(f"{what} is not valid Unicode (U+{ord(bad):04X} at character {e.start}: a lone "
                                 "surrogate, or bytes that are not UTF-8); fix the manifest") from None


def _holds_uris(t: pa.DataType) -> bool:
    """A media column of this type holds URIs (else embedded bytes: binary, or a struct of them)."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _per_row(fn, values: list, errors: list) -> list:
    """`fn(v)` per value; a row whose value raises `InputError` gets None and its message in `errors`
    (the first error of a row stays)."""
    out = []
    for i, v in enumerate(values):
        try:
            out.append(fn(v))
        except InputError as e:
            out.append(None)
            errors[i] = errors[i] or str(e)
    return out


def normalise(table: pa.Table, cfg, base_uri: str, *, file_uri: str | None = None,
              row_offset: int | None = None, keep: pa.Schema | None = None) -> pa.Table:
    """Any manifest block -> the manifest columns (`base.MANIFEST_SCHEMA`). `file_uri` and
    `row_offset` (the block's first row in that file) name embedded media that have no path
    (`<file>#<row>`); `keep`: the run's schema of `input.columns.keep`. A cell that cannot be
    used (a path climbing out of a remote manifest's bucket, invalid Unicode in a question)
    makes its row an error row (`error`), the other rows go on."""
    cols = cfg.input.columns
    if cols.media not in table.column_names:
        raise InputError(f"manifest has no column {cols.media!r} (input.columns.media); "
                         f"columns are: {', '.join(table.column_names)}")
    n = table.num_rows
    errors: list[str | None] = [None] * n
    allow = cfg.storage.allow_schemes
    uris, data, identity = _media(table.column(cols.media), base_uri, file_uri, row_offset, errors, allow)
    mtype = [cell(m) for m in table.column(cols.media_type).to_pylist()] \
        if cols.media_type in table.column_names else [None] * n
    mtype = [None if m is None else str(m) for m in mtype]
    if data is not None:  # embedded media: the type from the path's extension, else the bytes' signature
        mtype = [m if m is not None or b is None else media_type_of(u or "", b[:16])
                 for m, u, b in zip(mtype, uris, data, strict=True)]
    if cols.questions:
        if cols.questions not in table.column_names:
            raise InputError(f"manifest has no column {cols.questions!r} (input.columns.questions)")

        def checked(q):
            qs = questions(q)
            check_text(qs, f"column {cols.questions!r}")
            return qs

        qs = _per_row(checked, table.column(cols.questions).to_pylist(), errors)
    else:
        qs = [None] * n
    extra = {} if data is None else {"media_bytes": data, "identity": identity}
    if data is None and row_offset is not None:
        extra["identity"] = _name_missing(uris, file_uri or base_uri, row_offset, cols.media, errors)
    if keep is not None:
        extra["keep"] = encode_keep(select_keep(table, keep, f"manifest {file_uri or base_uri}"))
    if any(e is not None for e in errors):
        extra["error"] = errors
    return manifest_table(n, media_uri=uris, media_type=mtype, questions=qs, **extra)


def _name_missing(uris: list, where: str, row_offset: int, column: str, errors: list) -> list:
    """Identities of a URI block's rows: `<file>#<row>` for a null / empty media (each its own
    `InputError` row, never one id for all of them; `errors` gains the row number), else None."""
    ids: list[str | None] = []
    for i, u in enumerate(uris):
        if u is None or not u.strip():
            ids.append(f"{where}#{row_offset + i}")
            errors[i] = errors[i] or (f"manifest {where} row {row_offset + i} (from 0): column {column!r} "
                                      f"is {'null' if u is None else 'empty'} (input.columns.media)")
        else:
            ids.append(None)
    return ids


def _media(col: pa.ChunkedArray, base_uri: str, file_uri: str | None, row_offset: int | None,
           errors: list, allow: tuple[str, ...] = ()) -> tuple[list, list | None, list | None]:
    """(media URIs, embedded bytes or None, identities or None) of the media column: a string column of URIs, a
    binary column of bytes, or a struct of `bytes` and `path` (Hugging Face `datasets` Image /
    Video). Embedded media without a path are named `<file>#<row>`. A path that cannot be
    resolved keeps the manifest's value, its row an error (`errors`)."""
    def resolved(u):
        try:
            return resolve(u, base_uri, allow)
        except InputError as e:
            return e

    t = col.type
    if _holds_uris(t):
        raw = [cell(u) for u in col.to_pylist()]
        uris = [resolved(u) for u in raw]
        for i, u in enumerate(uris):
            if isinstance(u, InputError):
                uris[i], errors[i] = raw[i], errors[i] or str(u)
        return uris, None, None
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
    uris = []
    for i, (b, p) in enumerate(zip(data, paths, strict=True)):
        u = (p if b is not None else resolved(p)) if p else (None if b is None else f"{where}#{row_offset + i}")
        if isinstance(u, InputError):
            u, errors[i] = p, errors[i] or str(u)
        uris.append(u)
    # identity: the row (`<file>#<row>`), not the path: exports often name every image alike
    ids = [None if b is None or row_offset is None else f"{where}#{row_offset + i}" for i, b in enumerate(data)]
    return uris, data, ids
