"""Reading and writing through the one filesystem and retry policy.

- `read_bytes(uri, storage)`: all bytes of an object or file (media). A missing object,
  a missing bucket or denied access are permanent: `MediaError` at once, no retry;
  transient failures that outlast the retries, or an unclassified failure: `StorageError`.
- `open_input(fs, path, storage)`: a seekable binary stream (manifests, part files) whose
  reads are ranged requests, each retried on its own, so a transient failure in the middle
  of a large file costs one range, not the file.
- `arrow_filesystem(fs, storage)`: the same for pyarrow readers (Ray Data's read_parquet /
  read_json / read_csv): metadata calls and file opens retry, reads go through `open_input`.
- `put_atomic(fs, path, data, storage, tmp_dir=...)`: a file that is visible whole or not at
  all. Object stores (s3): one PUT (or one multipart upload, visible only at
  CompleteMultipartUpload) straight to the final key. Local / POSIX: the bytes go to a unique
  temp name (under `tmp_dir`, or beside `path`), then `os.replace` onto `path` (atomic within
  one filesystem). Other fsspec protocols: temp name + `mv`, atomic only where the store's
  rename is. Each attempt of the retry loop writes a fresh temp name.
"""
from __future__ import annotations

import io
import os
import uuid

from vlbatch.operators.errors import MediaError, StorageError
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions, filesystem, join
from vlbatch.operators.storage.retry import classify, describe, with_retries

STREAM_BUFFER = 8 << 20  # bytes per ranged request of `open_input` (sequential reads)


def read_bytes(uri: str, storage: StorageOptions = DEFAULT_STORAGE) -> bytes:
    """All bytes of the object or file at `uri`.

    Raises `MediaError` (permanent: not found, denied, a directory) or `StorageError`
    (transient failures outlasted every attempt, or an unclassified storage failure).
    """
    fs, path = filesystem(uri, storage)
    try:
        return with_retries(lambda: fs.cat_file(path), what=f"reading {uri}", storage=storage)
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - not retried: permanent or unclassified
        if classify(e) == "permanent":
            raise MediaError(f"cannot read {uri}: {describe(e)}") from e
        raise StorageError(f"reading {uri} failed: {describe(e)}") from e


class RangeReader(io.RawIOBase):
    """Read-only seekable file over `fs.cat_file(path, start, end)`; one retried request per read."""

    def __init__(self, fs, path: str, size: int, storage: StorageOptions):
        super().__init__()
        self._fs, self._path, self._size, self._storage = fs, path, size, storage
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), self._size - self._pos)
        if n <= 0:
            return 0
        start = self._pos
        data = with_retries(lambda: self._fs.cat_file(self._path, start=start, end=start + n),
                            what=f"reading {self._path} [{start}:{start + n}]", storage=self._storage)
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)


def open_input(fs, path: str, storage: StorageOptions = DEFAULT_STORAGE) -> io.BufferedReader:
    """A buffered, seekable binary stream over `path` in `fs`; reads retry (module docstring)."""
    size = with_retries(lambda: fs.size(path), what=f"size of {path}", storage=storage)
    return io.BufferedReader(RangeReader(fs, path, int(size), storage), buffer_size=STREAM_BUFFER)


def arrow_filesystem(fs, storage: StorageOptions = DEFAULT_STORAGE):
    """A `pyarrow.fs.PyFileSystem` over `fs` whose reading calls follow the retry policy."""
    from pyarrow.fs import PyFileSystem

    from vlbatch.operators.storage.arrow import RetryingHandler

    return PyFileSystem(RetryingHandler(fs, storage))


def _is_object_store(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return any(p in ("s3", "s3a", "gs", "gcs", "abfs", "az") for p in protos)


def _is_local(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protos or "local" in protos


def _put_once(fs, path: str, data: bytes, tmp_dir: str | None) -> None:
    if _is_object_store(fs):
        fs.pipe_file(path, data)  # one PUT: the object appears whole or not at all
        return
    name = path.rsplit("/", 1)[-1]
    if tmp_dir is None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    else:
        tmp = join(tmp_dir, f"{name}.{uuid.uuid4().hex}")
        fs.makedirs(tmp_dir, exist_ok=True)
    with fs.open(tmp, "wb") as f:
        f.write(data)
    if _is_local(fs):
        os.replace(tmp, path)
    else:
        fs.mv(tmp, path)


def put_atomic(fs, path: str, data: bytes, storage: StorageOptions = DEFAULT_STORAGE, *,
               tmp_dir: str | None = None) -> None:
    """Write `data` to `path` so that no partial file is ever visible there (module docstring)."""
    with_retries(lambda: _put_once(fs, path, data, tmp_dir), what=f"writing {path}", storage=storage)
