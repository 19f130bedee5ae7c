"""Atomic, deterministic commits of Parquet part files.

A run's committed output is the set of ``<run_dir>/part-<hash>.parquet`` files. The
name is a hash of the sorted request ids in the file, so a retried write of the same
rows lands on the same name (an idempotent overwrite, never a second copy).

No partially written file is ever visible under a committed name:
- local / POSIX: the bytes go to ``<run_dir>/_tmp/<name>.<uuid>`` and are renamed
  onto the final name (``os.replace`` is atomic within one filesystem). Leftover
  ``_tmp`` files of a killed writer are ignored by readers and removed on the next run.
- s3://: one PUT (or one multipart upload, which becomes visible only at
  CompleteMultipartUpload) creates the object whole; S3 has no partial objects, so the
  bytes are uploaded straight to the final key.
Other fsspec protocols use the local scheme (temp name + `mv`); that is atomic only
where the store's rename is.

Transient storage failures are retried with exponential backoff; when retries run
out the commit raises `StorageError` (nothing is committed, resume redoes the rows).
"""
from __future__ import annotations

import hashlib
import io
import os
import time
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from vlbatch.operators.errors import StorageError
from vlbatch.operators.writer.fs import join
from vlbatch.operators.writer.schema import OUTPUT_SCHEMA

PART_PREFIX = "part-"
PART_SUFFIX = ".parquet"
TMP_DIR = "_tmp"


def part_name(ids: list[str]) -> str:
    """Deterministic file name for a set of request ids (order-independent)."""
    h = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:24]
    return f"{PART_PREFIX}{h}{PART_SUFFIX}"


def _is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return any(p in ("s3", "s3a", "gs", "gcs", "abfs", "az") for p in protos)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protos or "local" in protos


def table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _write_once(fs: fsspec.AbstractFileSystem, run_dir: str, name: str, data: bytes) -> str:
    final = join(run_dir, name)
    if _is_object_store(fs):
        fs.pipe_file(final, data)  # one PUT: the object appears whole or not at all
        return final
    tmp = join(run_dir, TMP_DIR, f"{name}.{uuid.uuid4().hex}")
    fs.makedirs(join(run_dir, TMP_DIR), exist_ok=True)
    with fs.open(tmp, "wb") as f:
        f.write(data)
    if _is_local(fs):
        os.replace(tmp, final)
    else:
        fs.mv(tmp, final)
    return final


def with_retries(fn, *, what: str, retries: int = 5, base_s: float = 0.5, max_s: float = 8.0):
    """Call `fn()`; retry OSError-like failures with backoff; raise StorageError at the end."""
    delay = base_s
    for attempt in range(retries + 1):
        try:
            return fn()
        except (OSError, TimeoutError, ConnectionError) as e:
            last = e
        except Exception as e:  # botocore / aiohttp errors do not share a base class with OSError
            if type(e).__module__.split(".")[0] not in ("botocore", "aiobotocore", "aiohttp", "urllib3"):
                raise
            last = e
        if attempt < retries:
            time.sleep(delay)
            delay = min(max_s, delay * 2)
    raise StorageError(f"{what} failed after {retries + 1} attempts: {type(last).__name__}: {last}")


def commit_table(
    fs: fsspec.AbstractFileSystem, run_dir: str, table: pa.Table, *, retries: int = 5
) -> str | None:
    """Commit `table` (OUTPUT_SCHEMA) as one part file; returns its path (None if empty)."""
    if table.num_rows == 0:
        return None
    if not table.schema.equals(OUTPUT_SCHEMA):
        table = table.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)
    name = part_name(table.column("id").to_pylist())
    data = table_bytes(table)
    return with_retries(lambda: _write_once(fs, run_dir, name, data), what=f"commit {name}", retries=retries)


def write_json(fs: fsspec.AbstractFileSystem, path: str, text: str, *, retries: int = 5) -> None:
    """Write a small text file atomically (summary JSON)."""
    data = text.encode()

    def go():
        if _is_object_store(fs):
            fs.pipe_file(path, data)
            return
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        if _is_local(fs):
            os.replace(tmp, path)
        else:
            fs.mv(tmp, path)

    with_retries(go, what=f"write {path}", retries=retries)
