"""Files a job config or a command names (a response format's `schema_file`, the job config itself, a
checkpoint's small JSON files, `--runtime-env`), read whole with `read_named_file`, never a job's media
(those have their own limits: `io.read_bytes`).

Bounded whatever the file claims: a local path is opened with `O_NONBLOCK` (a FIFO never blocks the open)
and refused by `fstat` of that descriptor unless it is a regular file (a directory, a FIFO, a device such
as /dev/zero, a socket: no swap between a check and the open), and at most the kind's cap + 1 bytes are
read (a file that grew). A remote one (s3://, http(s)://) goes through `read_bytes` with the same cap.
Every refusal is a `NamedFileError` (a `ConfigError`), one line naming the field.

Caps, per kind of file (`FileKind`):

- `SCHEMA_FILE` 1 MiB: a JSON Schema of 1 MB is already absurd (issue 60);
- `JOB_CONFIG` 1 MiB: a job config YAML (with its inline schemas);
- `RUNTIME_ENV` 1 MiB: `vlbatch submit --runtime-env`;
- `CHECKPOINT_JSON` 16 MiB: config.json, model.safetensors.index.json, tokenizer_config.json (as a remote
  config.json is read);
- `CHECKPOINT_FILE` 64 MiB: a checkpoint's tokenizer and template files (tokenizer.json of the Qwen3.5 family:
  about 12 MB), hashed by the fingerprint and read by the stages (`checkpoint_text`).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from vlbatch.operators.errors import ConfigError, VlbatchError
from vlbatch.operators.storage.io import read_bytes
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions, is_local

_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileKind:
    """A kind of named file: what it is called in messages, and the most bytes one may hold."""

    name: str
    max_bytes: int

    def limit(self) -> str:
        mib = self.max_bytes / (1 << 20)
        return f"the {mib:g} MiB limit of a {self.name}"


SCHEMA_FILE = FileKind("schema file", 1 << 20)
JOB_CONFIG = FileKind("job config", 1 << 20)
RUNTIME_ENV = FileKind("runtime env file", 1 << 20)
CHECKPOINT_JSON = FileKind("checkpoint JSON file", 16 << 20)
CHECKPOINT_FILE = FileKind("checkpoint tokenizer or template file", 64 << 20)


class NamedFileError(ConfigError):
    """A named file refused: `field: cannot read path: reason` (`reason` alone for callers that word their own
    line)."""

    def __init__(self, field: str, path: str, reason: str):
        super().__init__(f"{field}: cannot read {path}: {reason}")
        self.field, self.path, self.reason = field, path, reason


def read_named_file(uri: str, *, field: str, kind: FileKind, storage: StorageOptions = DEFAULT_STORAGE) -> bytes:
    """The bytes of the file `uri` that the config's (or command's) `field` names, at most `kind.max_bytes`;
    `NamedFileError` naming `field` otherwise (module docstring)."""
    if "\x00" in uri:
        raise NamedFileError(field, repr(uri), "a path with a NUL byte")
    if is_local(uri):
        return _read_local(uri.removeprefix("file://"), field, kind)
    try:
        return read_bytes(uri, storage, max_bytes=kind.max_bytes, limit_name=kind.name)
    except VlbatchError as e:
        raise NamedFileError(field, uri, str(e).removeprefix(f"cannot read {uri}: ").removeprefix(f"{uri}: ")
                             ) from None


def checkpoint_text(path, kind: FileKind = CHECKPOINT_JSON) -> str:
    """A local checkpoint file (`path`: str or Path) as UTF-8 text, `read_named_file` of `model.path`: what the
    CPU and model stages read of a checkpoint goes through the same checks as `validate`'s reads."""
    return read_named_file(str(path), field="model.path", kind=kind).decode("utf-8")


def _read_local(path: str, field: str, kind: FileKind) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise NamedFileError(field, path, e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)  # the opened file itself: a path swapped after a check cannot slip through
        if stat.S_ISDIR(st.st_mode):
            raise NamedFileError(field, path, "a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise NamedFileError(field, path, "not a regular file (a FIFO, device or socket); give a file")
        if st.st_size > kind.max_bytes:
            raise NamedFileError(field, path, f"{st.st_size} bytes, over {kind.limit()}")
        data = _read_up_to(fd, kind.max_bytes + 1)
    except OSError as e:
        raise NamedFileError(field, path, e.strerror or str(e)) from None
    finally:
        os.close(fd)
    if len(data) > kind.max_bytes:  # it grew after fstat
        raise NamedFileError(field, path, f"more than {kind.max_bytes} bytes, over {kind.limit()}")
    return data


def _read_up_to(fd: int, limit: int) -> bytes:
    parts, got = [], 0
    while got < limit:
        chunk = os.read(fd, min(_CHUNK, limit - got))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
