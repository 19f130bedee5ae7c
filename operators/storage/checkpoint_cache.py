"""A remote `model.path` (an fsspec URI: s3://bucket/ckpt) -> a node-local checkpoint folder.

`fetch_checkpoint(uri, storage, cache_dir)` lists the checkpoint's files (one listing, under
the retry policy) and names the local folder after the URI *and* that listing (paths, sizes,
ETags): a checkpoint changed in place gets a new folder, never a mix. Every actor on a node
that asks for the same checkpoint takes one file lock (`<folder>.lock`, `filelock`): the
first downloads, the others wait and then find it. The download goes to a unique
`<folder>.partial-*` folder, each file's size (and its ETag, where the ETag is a plain MD5:
not a multipart upload's) is checked, then one `os.rename` publishes the folder: a partial
download is never used, and a download killed midway leaves only a `.partial-*` folder
(removed by the next download under the lock). Local paths are returned as they are.

Names from the bucket are untrusted: before anything is downloaded, every object key under the
prefix, and every shard name in its `model.safetensors.index.json` (read into memory, at most
`INDEX_MAX_BYTES`), must be a plain relative path inside the folder (`names.relative_name_problem`:
not absolute, no empty, `.` or `..` part); one that is not fails with one `ConfigError` naming
model.path and the name, and nothing is written (a key `ckpt/../../tmp/x` would otherwise be
written to `/tmp/x`).

The cache folder: `cache_dir`, else `$VLBATCH_CACHE`, else `~/.cache/vlbatch/checkpoints`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from vlbatch.operators.errors import ConfigError, StorageError
from vlbatch.operators.storage.names import printable, relative_name_problem
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions, filesystem, protocol_of
from vlbatch.operators.storage.retry import with_retries

MARKER = ".vlbatch-checkpoint.json"  # written last, inside the folder before the rename
INDEX_NAME = "model.safetensors.index.json"  # its weight_map's shard names are checked before the download
INDEX_MAX_BYTES = 64 << 20  # a larger index is refused (real ones are well under 1 MiB)


@dataclass(frozen=True)
class CachedCheckpoint:
    """path: the local folder; downloaded: whether this call did the download."""

    path: str
    downloaded: bool


def default_cache_dir() -> str:
    return os.environ.get("VLBATCH_CACHE") or os.path.expanduser("~/.cache/vlbatch/checkpoints")


def resolve_model_path(uri: str, storage: StorageOptions = DEFAULT_STORAGE, cache_dir: str | None = None) -> str:
    """`uri` itself when local, else its node-local copy (downloaded once per node)."""
    if protocol_of(uri) in ("file", "local"):
        return uri.removeprefix("file://")
    return fetch_checkpoint(uri, storage, cache_dir).path


def _listing(fs, path: str, uri: str, storage: StorageOptions) -> dict[str, dict]:
    """{relative name: {"size", "etag"}} of every file under the checkpoint."""
    found = with_retries(lambda: fs.find(path, detail=True), what=f"listing {uri}", storage=storage)
    out = {}
    for full, info in sorted(found.items()):
        if info.get("type", "file") != "file" or (full.endswith("/") and int(info.get("size") or 0) == 0):
            continue  # a folder, or an empty `name/` folder marker (what consoles write): no file
        rel = full[len(path) + 1:] if full.startswith(path + "/") else full
        if (why := relative_name_problem(rel)) is not None:
            raise ConfigError(f"model.path: the object {printable(full)!r} under {uri!r} {why}; a checkpoint's keys "
                              "must be plain names inside its prefix: nothing was downloaded (fix the bucket)")
        etag = info.get("ETag") or info.get("etag")
        out[rel] = {"size": int(info["size"]), "etag": etag.strip('"') if etag else None}
    if not out:
        raise ConfigError(f"model.path: no files under {uri!r}")
    return out


def check_names(uri: str, storage: StorageOptions = DEFAULT_STORAGE) -> None:
    """The checks `fetch_checkpoint` makes before downloading, alone (`vlbatch validate`): one
    listing, the index's shard names; `ConfigError` naming model.path when a name would leave
    the folder."""
    fs, path = filesystem(uri, storage)
    _check_index(fs, path.rstrip("/"), uri, _listing(fs, path.rstrip("/"), uri, storage), storage)


def fetch_checkpoint(uri: str, storage: StorageOptions = DEFAULT_STORAGE,
                     cache_dir: str | None = None) -> CachedCheckpoint:
    """The local copy of the checkpoint at `uri` (module docstring)."""
    from filelock import FileLock

    fs, path = filesystem(uri, storage)
    files = _listing(fs, path.rstrip("/"), uri, storage)
    _check_index(fs, path.rstrip("/"), uri, files, storage)
    sig = json.dumps({"uri": uri, "files": files}, sort_keys=True)
    root = Path(cache_dir or default_cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    final = root / hashlib.sha256(sig.encode()).hexdigest()[:20]
    with FileLock(str(final) + ".lock"):
        if (final / MARKER).is_file():
            return CachedCheckpoint(str(final), False)
        for stale in root.glob(final.name + ".partial-*"):  # a download that died midway
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f"{final.name}.partial-{uuid.uuid4().hex}"
        try:
            _download(fs, path.rstrip("/"), uri, files, tmp, storage)
            (tmp / MARKER).write_text(sig)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return CachedCheckpoint(str(final), True)


def _check_index(fs, path: str, uri: str, files: dict[str, dict], storage: StorageOptions) -> None:
    """The shard names of the checkpoint's `INDEX_NAME`, if it has one, before anything is written
    (module docstring). A malformed index is the loader's to report; only the names are judged here."""
    if INDEX_NAME not in files:
        return
    if files[INDEX_NAME]["size"] > INDEX_MAX_BYTES:
        raise ConfigError(f"model.path: {uri}/{INDEX_NAME} is {files[INDEX_NAME]['size']} bytes, over "
                          f"{INDEX_MAX_BYTES}: not a safetensors index")
    raw = with_retries(lambda: fs.cat_file(f"{path}/{INDEX_NAME}"), what=f"reading {uri}/{INDEX_NAME}",
                       storage=storage)
    try:
        weight_map = json.loads(raw).get("weight_map")
    except (ValueError, AttributeError):
        return
    for shard in sorted(set(weight_map.values()), key=str) if isinstance(weight_map, dict) else ():
        if (why := relative_name_problem(shard)) is not None:
            raise ConfigError(f"model.path: {uri}/{INDEX_NAME} names the shard {printable(str(shard))!r}, which "
                              f"{why}; shard names must be files inside the checkpoint folder: nothing was "
                              "downloaded")


def _download(fs, path: str, uri: str, files: dict[str, dict], tmp: Path, storage: StorageOptions) -> None:
    for rel, want in files.items():
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with_retries(lambda r=rel, d=dest: fs.get_file(f"{path}/{r}", str(d)), what=f"downloading {uri}/{rel}",
                     storage=storage)
        size = dest.stat().st_size
        if size != want["size"]:
            raise StorageError(f"downloading {uri}/{rel}: {size} bytes, the listing says {want['size']}")
        etag = want["etag"]
        if etag and "-" not in etag and len(etag) == 32 and _md5(dest) != etag:
            raise StorageError(f"downloading {uri}/{rel}: the MD5 does not match the ETag {etag}")


def _md5(p: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
