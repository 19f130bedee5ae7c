"""Reading and writing through the one filesystem and retry policy.

- `read_bytes(uri, storage, max_bytes=...)`: all bytes of an object or file (media). A missing
  object, a missing bucket, denied access, a symlink loop or a non-regular local file (FIFO,
  device, socket, directory) are permanent: `MediaError` at once, no retry; transient failures
  that outlast the retries, or an unclassified failure: `StorageError`. The size is checked
  before the bytes are read (local: `fstat` of the descriptor, opened with `O_NONBLOCK` so a
  FIFO never blocks; s3: the object's size from HEAD) and at most `max_bytes + 1` bytes are
  read (an object that grew in between): over the limit is `InputError`. http(s):// URLs go
  to `http.read_http` (its own retry rules: 429 Retry-After, 404/403/410 permanent), with the
  caller's per-host `HostLimiter`.
- `open_media(uri, storage, max_bytes=...)`: the same media as a `media_file.MediaFile` (a descriptor the
  decoder child reads, the bytes held once): a local file opened and checked as above, other bytes read
  as above into a sealed memfd.
- `open_input(fs, path, storage)`: a seekable binary stream (manifests, part files) whose
  reads are ranged requests, each retried on its own, so a transient failure in the middle
  of a large file costs one range, not the file.
- (`arrow_filesystem` lives in storage/arrow.py, so this module does not import it back) the same for
  pyarrow readers (Ray Data's read_parquet / read_json / read_csv): metadata calls and file opens
  retry, reads go through `open_input`.
- `put_atomic(fs, path, data, storage, tmp_dir=...)`: a file that is visible whole or not at
  all. Object stores (s3): one PUT (or one multipart upload, visible only at
  CompleteMultipartUpload) straight to the final key. Local / POSIX: the bytes go to a unique
  temp name (`<name>.<32 hex>.vlbatch-tmp`, under `tmp_dir` or beside `path`: the mark by which
  a sink knows its own debris), then `os.replace` onto `path` (atomic within one filesystem). Other
  fsspec protocols: temp name + `mv`, atomic only where the store's rename is. Each attempt of the
  retry loop writes a fresh temp name, and deletes it when it fails; a full disk or quota (ENOSPC /
  EDQUOT) is `StorageError: no space left on <folder>` (not retried). `replace_file(uri, data, storage)`: a run
  file (`_fingerprint.json`) written so, the temp names a killed earlier write left of it deleted first.
"""
from __future__ import annotations

import errno
import io
import os
import re
import uuid

from vlbatch.operators.errors import InputError, MediaError, StorageError, VlbatchError
from vlbatch.operators.storage.media_file import MediaFile, SizedReader, memfd_of, open_checked
from vlbatch.operators.storage.names import check_no_nul
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions, filesystem, join
from vlbatch.operators.storage.retry import classify, describe, with_retries

STREAM_BUFFER = 8 << 20  # bytes per ranged request of `open_input` (sequential reads)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: one line naming the folder
TMP_MARK = ".vlbatch-tmp"  # `put_atomic`'s temp names: `<name>.<32 hex>.vlbatch-tmp` (what cleanup may delete)


def read_bytes(uri: str, storage: StorageOptions = DEFAULT_STORAGE, *, max_bytes: int | None = None,
               limit_name: str = "max_bytes", limiter=None) -> bytes:
    """All bytes of the object or file at `uri`, at most `max_bytes` (None: no limit).

    Raises `MediaError` (permanent: not found, denied, a directory, a symlink loop, not a
    regular file), `InputError` (over `max_bytes`, the message naming `limit_name`; a NUL byte
    in `uri`) or
    `StorageError` (transient failures outlasted every attempt, or an unclassified failure).
    `limiter`: an `http.HostLimiter` for http(s):// URLs (None: no per-host limit).
    """
    from vlbatch.operators.storage.http import is_http, read_http

    check_no_nul(uri)  # bad input (InputError, permanent), whatever the scheme: never a retried StorageError
    if is_http(uri):
        return read_http(uri, storage, max_bytes=max_bytes, limit_name=limit_name, limiter=limiter)
    fs, path = filesystem(uri, storage)
    read = _read_local if _is_local(fs) else _read_remote
    data = _guarded(uri, storage, lambda: read(fs, path, uri, max_bytes, limit_name))
    if max_bytes is not None and len(data) > max_bytes:  # it grew after the size check
        raise InputError(f"{uri}: more than {max_bytes} bytes, over the {limit_name} limit of {max_bytes}")
    return data


def open_media(uri: str, storage: StorageOptions = DEFAULT_STORAGE, *, max_bytes: int | None = None,
               limit_name: str = "max_bytes", limiter=None) -> MediaFile:
    """The media at `uri` as a `MediaFile` (the caller closes it), its bytes held once: a local file
    opened and checked as `read_bytes` checks it (its descriptor: later reads see exactly the checked
    file), anything else read (`read_bytes`, the same errors) into a sealed memfd and the bytes dropped."""
    from vlbatch.operators.storage.http import is_http

    check_no_nul(uri)
    if not is_http(uri):
        fs, path = filesystem(uri, storage)
        if _is_local(fs):
            return _guarded(uri, storage, lambda: open_checked(path, uri, max_bytes, limit_name))
    data = read_bytes(uri, storage, max_bytes=max_bytes, limit_name=limit_name, limiter=limiter)
    return memfd_of(data)


def _guarded(uri: str, storage: StorageOptions, read):
    """`read()` under the retry policy; a failure not ours (`VlbatchError`) becomes `MediaError` when
    permanent, else `StorageError`."""
    try:
        return with_retries(read, what=f"reading {uri}", storage=storage)
    except VlbatchError:  # MediaError / InputError from the checks, StorageError after the retries
        raise
    except Exception as e:  # noqa: BLE001 - not retried: permanent or unclassified
        if classify(e) == "permanent":
            raise MediaError(f"cannot read {uri}: {describe(e)}") from e
        raise StorageError(f"reading {uri} failed: {describe(e)}") from e


def _check_size(uri: str, size: int, max_bytes: int | None, limit_name: str) -> None:
    if max_bytes is not None and size > max_bytes:
        raise InputError(f"{uri}: {size} bytes is over the {limit_name} limit of {max_bytes}")


def _read_local(fs, path: str, uri: str, max_bytes: int | None, limit_name: str) -> bytes:
    """A regular local file (`media_file.open_checked`), read up to `max_bytes + 1` bytes."""
    with open_checked(path, uri, max_bytes, limit_name) as media, os.fdopen(os.dup(media.fd), "rb", buffering=0) as f:
        return _read_up_to(f, None if max_bytes is None else max_bytes + 1)


def _read_up_to(f, limit: int | None) -> bytes:
    if limit is None:
        return f.readall()
    buf = bytearray()
    while len(buf) < limit:
        chunk = f.read(min(limit - len(buf), STREAM_BUFFER))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _read_remote(fs, path: str, uri: str, max_bytes: int | None, limit_name: str) -> bytes:
    """An object store / other fsspec file; with a limit, its size first (HEAD), then one
    ranged GET of at most `max_bytes + 1` bytes."""
    if max_bytes is None:
        return fs.cat_file(path)
    size = int(fs.size(path))
    _check_size(uri, size, max_bytes, limit_name)
    if size == 0:
        return b""  # a range over an empty object is a 416
    return fs.cat_file(path, start=0, end=max_bytes + 1)


class RangeReader(SizedReader):
    """Read-only seekable file over `fs.cat_file(path, start, end)`; one retried request per read."""

    def __init__(self, fs, path: str, size: int, storage: StorageOptions):
        super().__init__(size)
        self._fs, self._path, self._storage = fs, path, storage

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


def bucket_exists(fs, bucket: str, storage: StorageOptions = DEFAULT_STORAGE) -> bool:
    """Whether `bucket` of the object store `fs` exists: one HEAD bucket under the retry policy
    (s3fs's `exists` answers False for an unreachable endpoint too; this raises `StorageError`)."""
    def head() -> bool:
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            return False
        return True

    try:
        return with_retries(head, what=f"checking the bucket {bucket}", storage=storage)
    except StorageError:
        raise
    except PermissionError:
        return False  # 403: not ours to see, as good as missing
    except Exception as e:  # noqa: BLE001 - unclassified: one line, not a traceback
        raise StorageError(f"checking the bucket {bucket} failed: {describe(e)}") from e


def is_object_store(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return any(p in ("s3", "s3a", "gs", "gcs", "abfs", "az") for p in protos)


def _is_local(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protos or "local" in protos


def _put_once(fs, path: str, data: bytes, tmp_dir: str | None) -> None:
    if is_object_store(fs):
        fs.pipe_file(path, data)  # one PUT: the object appears whole or not at all
        return
    name = path.rsplit("/", 1)[-1]
    tmp_name = f"{name}.{uuid.uuid4().hex}{TMP_MARK}"
    folder = (path.rsplit("/", 1)[0] or "/") if tmp_dir is None else tmp_dir  # where the bytes go
    tmp = f"{path}.{uuid.uuid4().hex}{TMP_MARK}" if tmp_dir is None else join(tmp_dir, tmp_name)
    try:
        if tmp_dir is not None:
            fs.makedirs(tmp_dir, exist_ok=True)
        with fs.open(tmp, "wb") as f:
            f.write(data)
        if _is_local(fs):
            os.replace(tmp, path)
        else:
            fs.mv(tmp, path)
    except BaseException as e:
        _drop(fs, tmp)  # a failed write leaves no debris (a killed process's is the next start's: sinks' prepare)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise StorageError(f"no space left on {folder} (writing {name}, {len(data)} bytes): "
                               f"free space there, then rerun to resume") from e
        raise


def _drop(fs, tmp: str) -> None:
    """Delete `tmp` if it is there; a failure to delete is not the caller's error."""
    try:
        if fs.exists(tmp):
            fs.rm_file(tmp)
    except OSError:
        pass


def put_atomic(fs, path: str, data: bytes, storage: StorageOptions = DEFAULT_STORAGE, *,
               tmp_dir: str | None = None) -> None:
    """Write `data` to `path` so that no partial file is ever visible there (module docstring)."""
    with_retries(lambda: _put_once(fs, path, data, tmp_dir), what=f"writing {path}", storage=storage)


def replace_file(uri: str, data: bytes | None, storage: StorageOptions = DEFAULT_STORAGE) -> None:
    """A small run file (`_fingerprint.json`) at `uri`: first delete what an earlier writer killed mid-write
    left of it (`put_atomic`'s temp names `<name>.<32 hex>.vlbatch-tmp` beside it; only those names: one
    writer per run folder, so none is live); then, unless `data` is None, write it (`put_atomic`; a local
    parent folder is made first, never a bucket)."""
    fs, path = filesystem(uri, storage)
    folder, name = path.rsplit("/", 1)
    local = not is_object_store(fs)  # one PUT there, no temp names, no folders
    if local and fs.isdir(folder):
        mark = re.compile(re.escape(name) + r"\.[0-9a-f]{32}" + re.escape(TMP_MARK))
        for found in fs.ls(folder, detail=False):
            if mark.fullmatch(found.rsplit("/", 1)[-1]):
                try:
                    fs.rm_file(found)
                except FileNotFoundError:
                    pass
    if data is None:
        return
    if local:
        fs.makedirs(folder, exist_ok=True)
    put_atomic(fs, path, data, storage)
