"""Untrusted names, checked before they reach a filesystem.

- `check_no_nul(uri)`: a NUL byte can be in no file or object name (the OS refuses it with
  `ValueError: embedded null byte`, S3 and HTTP with other errors): the request is bad input,
  an `InputError` (permanent: resume keeps the row), never a storage failure to retry.
- `relative_name_problem(name)`: why a name from untrusted data (an object key under a
  checkpoint prefix, a shard name in `model.safetensors.index.json`) would not stay inside the
  folder it is joined to: empty, absolute (a leading `/` or `\\`), or with an empty, `.` or `..`
  part (split at `/` and `\\`, so a name is judged the same on every OS). None when it is
  a plain relative path. Nothing is normalised: a name that needs normalising is refused.
"""
from __future__ import annotations

import re

from vlbatch.operators.errors import InputError

NUL = "\x00"
_PARTS = re.compile(r"[/\\]")


def printable(name: str, limit: int = 300) -> str:
    """`name` for a one-line message: control characters escaped (`\\x00`), at most `limit` characters."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name[:limit])
    return text + ("..." if len(name) > limit else "")


def check_no_nul(uri: str) -> None:
    """`InputError` when `uri` holds a NUL byte (module docstring)."""
    if NUL in uri:
        raise InputError(f"{printable(uri)}: a NUL byte in the path; no file or object can have that name")


def relative_name_problem(name: object) -> str | None:
    """None for a plain relative path that stays inside its folder; else why not (module docstring)."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if NUL in name:
        return "holds a NUL byte"
    if name[0] in "/\\":
        return "is absolute (it would be outside the folder)"
    if any(part in ("", ".", "..") for part in _PARTS.split(name)):
        return "has an empty, '.' or '..' part (it could be outside the folder)"
    return None


def run_folder_name(run_id: str | None) -> str | None:
    """The job config's `output.run_id` validator: '.' / '..' pass its pattern but name output.uri itself or its
    parent (the run's files would mix with other runs', or land, and be cleaned up, beside the output folder):
    `ValueError` (pydantic names the field)."""
    if run_id in (".", ".."):
        raise ValueError(f"{run_id!r} is not a folder inside output.uri (it names output.uri itself or the "
                         "folder above it); use a name such as 'run-1'")
    return run_id
