"""`input.format: webdataset`: tar shards of samples (LAION / DataComp layout).

`input.uri` names the shards: a glob (`shards/*.tar`, local or s3://), the brace notation
WebDataset users write (`shards/train-{000000..000127}.tar`, also `{a,b}`; expanded here,
zero padding kept), or one shard; local, s3:// or http(s):// (http(s): braces only, no
listing). The shards are listed in the driver (sorted within each brace expansion) and each
is read by one task, as a stream (`tarfile` mode `r|*`: never whole in memory; http(s) shards
through `storage.http_stream.open_http`, others through `storage.open_input`).

Samples follow the WebDataset convention: consecutive members sharing a *key* (the member's
path up to the first '.' of its file name) form a sample, the rest of the name is the member's
extension. A sample's media is its first member whose extension is in `IMAGE_EXTS` (an image)
or `VIDEO_EXTS` (a video); its row: `media_uri` = `<shard>#<key>.<ext>`, the bytes in
`media_bytes`, `identity` = the key (request ids hash the key, so they survive moving the
shards; keys must be unique across the dataset, as WebDataset writers make them: two samples
with one key are one media to resume and to duplicate dropping). `input.columns.keep` names member
extensions (`txt`, `json`, `cls`) kept as strings.

Members are read with a bound (`MemberLimits`): a media member's size in its tar header is
checked against `image.max_bytes` / `video.max_bytes` before a byte of it is read (over it: the
sample is an `InputError` row, the member skipped in the stream), kept text members against
16 MiB; members that are neither media nor kept are not read at all.

Errors are rows, not task failures: a sample without a media member, a member that cannot be
read (a corrupt header) and a shard that ends early (truncated) give `error` rows
(`InputError`) for what they spoil: the sample being read, or the shard itself when nothing
could be read from it. The samples before stay; the rest of the shard gives no rows. A shard
that cannot be opened after the storage retries, or whose stream fails mid-way (an http(s)
shard under `http_min_bytes_per_s`, a reset: `http_stream.py`), ends the same way but as a
`StorageError` row (transient: a resume reads the shard again and retries that sample).
"""
from __future__ import annotations

import re
import tarfile
import zlib
from dataclasses import dataclass

import pyarrow as pa
import ray

from vlbatch.operators.errors import ConfigError, StorageError, transient_source_error
from vlbatch.operators.storage import filesystem, open_input, with_retries
from vlbatch.operators.storage.http import is_http
from vlbatch.operators.storage.http_stream import open_http
from vlbatch.operators.storage.options import with_protocol
from vlbatch.pipeline.sources.base import Source, limit, manifest_table, task_pool

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """'a-{00..02}.tar' -> ['a-00.tar', 'a-01.tar', 'a-02.tar']; '{x,y}' -> alternatives
    (the first brace group left to right, recursively; zero padding of the lower bound kept)."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[:m.start()], pattern[m.end():]
    r = _RANGE.match(body)
    if r is not None:
        lo, hi = int(r.group(1)), int(r.group(2))
        if hi < lo:
            raise ConfigError(f"input.uri: empty range {{{body}}} in {pattern!r}")
        width = len(r.group(1))
        alts = [str(i).zfill(width) for i in range(lo, hi + 1)]
    else:
        alts = body.split(",")
    return [out for a in alts for out in expand_braces(head + a + tail)]


def split_name(name: str) -> tuple[str, str]:
    """A member path -> (key, extension): 'dir/0001.seg.jpg' -> ('dir/0001', 'seg.jpg')."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{folder}/{stem}" if folder else stem
    return key, ext.lower() if dot else ""


class WebDatasetSource(Source):
    """Shards listed in the driver; one read task per shard (module docstring)."""

    def embeds_media(self) -> bool:
        return True

    def shards(self) -> list[str]:
        inp, storage = self.cfg.input, self.storage
        out: list[str] = []
        for uri in expand_braces(inp.uri):
            if is_http(uri) or not any(c in uri for c in "*?["):
                out.append(uri)
                continue
            fs, path = filesystem(uri, storage)
            found = sorted(with_retries(lambda p=path, f=fs: f.glob(p), what=f"listing {uri}", storage=storage))
            out.extend(with_protocol(uri, f) for f in found)
        if not out:
            raise ConfigError(f"input.uri: {inp.uri!r} matches no shards")
        return out

    def check(self) -> None:
        """`input.columns.keep` names members of the first shard's first sample (`first_sample`: its
        headers read, at most `FIRST_SAMPLE_MEMBERS`), else `ConfigError` listing the members there are."""
        keep = self.cfg.input.columns.keep
        if not keep:
            return
        shard = self.shards()[0]
        key, exts = first_sample(shard, self.storage)
        missing = [k for k in keep if k not in exts]
        if key is not None and missing:
            raise ConfigError(f"input.columns.keep: the first sample {key!r} of {shard} has no member "
                              f"{', '.join(map(repr, missing))}; members are: {', '.join(sorted(exts))}")

    def keep_schema(self) -> pa.Schema | None:
        names = self.cfg.input.columns.keep
        return pa.schema([(n, pa.string()) for n in names]) if names else None

    def read(self, *, num_cpus: float | None = None, concurrency: int | None = None) -> ray.data.Dataset:
        items = [{"shard": s} for s in self.shards()]
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _read_shards, batch_format="pyarrow", batch_size=1, num_cpus=num_cpus, compute=task_pool(concurrency),
            fn_kwargs={"cfg": self.cfg, "keep": self.cfg.input.columns.keep})
        return limit(ds, self.cfg.input.limit)


def _read_shards(batch: pa.Table, *, cfg, keep: tuple[str, ...]):
    """A batch of shard URIs -> manifest blocks (one per `BLOCK_SAMPLES` samples)."""
    for shard in batch.column("shard").to_pylist():
        rows: list[dict] = []
        limits = MemberLimits(image=cfg.image.max_bytes, video=cfg.video.max_bytes)
        for row in read_shard(shard, cfg.storage.options(), keep, limits):
            rows.append(row)
            if len(rows) == BLOCK_SAMPLES:
                yield _block(rows, keep)
                rows = []
        if rows:
            yield _block(rows, keep)


BLOCK_SAMPLES = 256  # samples per manifest block (bounded memory per read task)


def _block(rows: list[dict], keep: tuple[str, ...]) -> pa.Table:
    from vlbatch.pipeline.sources.keep import encode

    cols = {k: [r.get(k) for r in rows] for k in ("media_uri", "media_type", "media_bytes", "identity", "error")}
    if keep:
        cols["keep"] = encode(pa.table({k: pa.array([r["kept"].get(k) for r in rows], pa.string()) for k in keep}))
    return manifest_table(len(rows), **cols)


def _open(shard: str, storage):
    if is_http(shard):
        return open_http(shard, storage)
    fs, path = filesystem(shard, storage)
    return open_input(fs, path, storage)


@dataclass(frozen=True)
class MemberLimits:
    """Bytes read at most per member: media by kind (`image.max_bytes` / `video.max_bytes`), kept
    text members (`input.columns.keep`) `text`; other members are never read (the stream skips them)."""

    image: int = 64 << 20
    video: int = 2 << 30
    text: int = 16 << 20

    def of(self, ext: str, keep: tuple[str, ...]) -> tuple[int, str] | None:
        """(limit, its name) of a member with extension `ext`; None: not read."""
        last = ext.rsplit(".", 1)[-1]
        if last in IMAGE_EXTS:
            return self.image, "image.max_bytes"
        if last in VIDEO_EXTS:
            return self.video, "video.max_bytes"
        return (self.text, "a kept member's limit") if ext in keep else None


class _TooBig:
    """A member over its limit, never read: its sample becomes an `InputError` row with `message`."""

    def __init__(self, message: str):
        self.message = message


def _member(tar, info, shard: str, ext: str, keep: tuple[str, ...], limits: MemberLimits):
    """A member's bytes; its size from the tar header is checked against its limit first, and at
    most that many bytes are read (`_TooBig` over it, None for a member nobody reads)."""
    limit = limits.of(ext, keep)
    if limit is None:
        return None
    max_bytes, name = limit
    if info.size > max_bytes:
        return _TooBig(f"{shard}#{info.name}: {info.size} bytes is over the {name} limit of {max_bytes}")
    member = tar.extractfile(info)
    return member.read(max_bytes) if member is not None else b""


def read_shard(shard: str, storage, keep: tuple[str, ...] = (), limits: MemberLimits = MemberLimits()):
    """The sample rows of one shard (dicts of manifest columns plus `kept`), streamed; members read
    up to `limits` (memory bounded by the largest allowed member)."""
    key, members, seen = None, {}, 0
    try:
        with _open(shard, storage) as f, tarfile.open(fileobj=f, mode="r|*") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                k, ext = split_name(info.name)
                if key is not None and k != key:
                    seen += 1
                    yield _sample(shard, key, members, keep)
                    members = {}
                key = k
                data = _member(tar, info, shard, ext, keep, limits)
                members[ext] = b"" if data is None else data  # an unread member: named in messages only
    except StorageError as e:  # the shard could not be opened, or its stream failed (http: too slow)
        yield _cut(shard, key, transient_source_error(f"{_what(key)} not read: {e}"))
        return
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as e:
        yield _cut(shard, key, f"{shard}: truncated or corrupt tar at {_what(key)} ({type(e).__name__}: {e})")
        return
    if key is not None:
        yield _sample(shard, key, members, keep)
    elif seen == 0:
        yield {"media_uri": shard, "error": f"{shard}: no samples (empty shard)", "kept": {}}


FIRST_SAMPLE_MEMBERS = 64  # member headers `first_sample` reads at most


def first_sample(shard: str, storage) -> tuple[str | None, set[str]]:
    """(key, member extensions) of a shard's first sample, from the member headers up to the next
    key (no member's bytes kept); (None, empty) when the tar cannot be read (the run makes its rows)."""
    key, exts = None, set()
    try:
        with _open(shard, storage) as f, tarfile.open(fileobj=f, mode="r|*") as tar:
            for n, info in enumerate(tar):
                k, ext = split_name(info.name)
                if not info.isfile():
                    continue
                if (key is not None and k != key) or n >= FIRST_SAMPLE_MEMBERS:
                    break
                key = k
                exts.add(ext)
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error):  # not StorageError: the preflight's
        return None, set()
    return key, exts


def _what(key: str | None) -> str:
    return f"sample {key!r}" if key is not None else "the shard"


def _cut(shard: str, key: str | None, error: str) -> dict:
    """The row of a shard that ended early: the sample being read (`key`), or the shard itself."""
    return {"media_uri": f"{shard}#{key}" if key is not None else shard, "identity": key, "error": error, "kept": {}}


def _sample(shard: str, key: str, members: dict, keep: tuple[str, ...]) -> dict:
    too_big = next((m.message for m in members.values() if isinstance(m, _TooBig)), None)
    if too_big is not None:
        return {"media_uri": f"{shard}#{key}", "identity": key, "kept": {}, "error": too_big}
    kept = {k: members[k].decode("utf-8", "replace") for k in keep if k in members}
    for kind, exts in (("image", IMAGE_EXTS), ("video", VIDEO_EXTS)):
        ext = next((e for e in members if e.rsplit(".", 1)[-1] in exts), None)
        if ext is not None:
            return {"media_uri": f"{shard}#{key}.{ext}", "media_type": kind, "media_bytes": members[ext],
                    "identity": key, "kept": kept}
    return {"media_uri": f"{shard}#{key}", "identity": key, "kept": kept,
            "error": f"sample {key!r} of {shard} has no image or video member (members: {', '.join(sorted(members))})"}
