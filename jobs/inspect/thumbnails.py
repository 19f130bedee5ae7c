"""Small JPEG thumbnails of a run's media, for `vlbatch inspect --html`.

Media are read through the one storage layer, as the run read them: a plain URI (local,
s3://, http(s)://) with `read_bytes`; a WebDataset member `<shard>#<key>.<ext>` by streaming
its shard once with `tarfile` (every wanted member of one shard in one pass); embedded bytes
`<file.parquet>#<row>` from that row of the manifest's media column. Images are decoded by
`load_image`; a video by `decode_video` (the killable child) with the run's frame sampling, so
its strip shows frames at the timestamps the model saw (`strip_frames` of them, evenly picked); a
clipped video's timeline one frame per clip (`clip_frames`).

Limits: each medium's bytes are at most `max_bytes` (refused from stat / HEAD / tar headers
before reading), a video's decoded frames at most `max_frame_bytes`, each thumbnail at most
`size` pixels on its long side. A medium that cannot be read or decoded is a placeholder
(`Thumb.note` says why); nothing here raises for one medium.
"""
from __future__ import annotations

import io
import posixpath
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from vlbatch.operators.errors import InputError, MediaError, VlbatchError, stable_message
from vlbatch.operators.media.video import DEFAULT_SAMPLING, FrameSampling
from vlbatch.operators.storage import DEFAULT_STORAGE, StorageOptions, filesystem, open_input, read_bytes

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class ThumbOptions:
    storage: StorageOptions = DEFAULT_STORAGE
    sampling: FrameSampling = DEFAULT_SAMPLING  # the run's `video` settings
    media_column: str | None = None  # embedded bytes: the manifest's media column (None: its first binary one)
    max_bytes: int = 64 << 20  # per medium read
    max_frame_bytes: int = 1 << 30  # a video's decoded sampled frames
    size: int = 256  # long side of an image thumbnail, pixels
    strip_frames: int = 6  # frames of a video strip
    strip_size: int = 128  # long side of one strip frame
    quality: int = 70  # JPEG quality
    backend: str = "decord"
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Frame:
    jpeg: bytes
    width: int
    height: int
    label: str | None = None  # a video frame's timestamp, e.g. "1.5 s"


@dataclass(frozen=True)
class Thumb:
    frames: tuple[Frame, ...] = ()  # one for an image, a strip for a video; none: a placeholder
    note: str | None = None  # why there is no picture, or what the strip shows


def thumbnails(media: Iterable[tuple[str | None, str | None]], opts: ThumbOptions = ThumbOptions()
               ) -> dict[str, Thumb]:
    """{uri: Thumb} for each distinct (uri, media_type); a None or empty uri is left out."""
    kinds = {u: k for u, k in media if u}
    data = fetch_all(list(kinds), opts)
    out = {}
    for uri, kind in kinds.items():
        got = data[uri]
        out[uri] = got if isinstance(got, Thumb) else _thumb(got, kind, uri, opts)
    return out


def placeholder(e: BaseException) -> Thumb:
    name = e.error_type if isinstance(e, VlbatchError) else type(e).__name__
    return Thumb(note=f"{name}: {stable_message(str(e))[:300]}")


def split_uri(uri: str) -> tuple[str, str, str | None]:
    """('tar', shard, member) | ('parquet', file, row) | ('plain', uri, None)."""
    head, sep, frag = uri.rpartition("#")
    if sep and frag:
        if head.lower().endswith(TAR_SUFFIXES):
            return "tar", head, frag
        if head.lower().endswith(".parquet") and frag.isdigit():
            return "parquet", head, frag
    return "plain", uri, None


def fetch_all(uris: list[str], opts: ThumbOptions) -> dict[str, bytes | Thumb]:
    """{uri: bytes, or a placeholder Thumb}: archives and manifests are opened once for all their media."""
    groups: dict[tuple[str, str], dict[str, str]] = {}
    out: dict[str, bytes | Thumb] = {}
    for uri in uris:
        how, where, part = split_uri(uri)
        if how == "plain":
            out[uri] = _guarded(lambda u=uri: read_bytes(u, opts.storage, max_bytes=opts.max_bytes,
                                                         limit_name="the thumbnail byte limit"))
        else:
            groups.setdefault((how, where), {})[part] = uri
    for (how, where), parts in groups.items():
        read = _tar_members if how == "tar" else _parquet_rows
        try:
            found = read(where, set(parts), opts)
        except Exception as e:  # noqa: BLE001 - a preview: any failure is this group's placeholder
            found = {p: placeholder(e) for p in parts}
        for part, uri in parts.items():
            out[uri] = found.get(part) or Thumb(note=f"MediaError: {part!r} not found in {where}")
    return out


def _guarded(fn) -> bytes | Thumb:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a preview: any failure is this medium's placeholder
        return placeholder(e)


def _open(uri: str, storage: StorageOptions):
    from vlbatch.operators.storage.http import is_http
    from vlbatch.operators.storage.http_stream import open_http

    if is_http(uri):
        return open_http(uri, storage)
    fs, path = filesystem(uri, storage)
    return open_input(fs, path, storage)


def _tar_members(shard: str, wanted: set[str], opts: ThumbOptions) -> dict[str, bytes | Thumb]:
    """The wanted members (`<key>.<ext>` names) of one shard, streamed until all are found."""
    out: dict[str, bytes | Thumb] = {}
    with _open(shard, opts.storage) as f, tarfile.open(fileobj=f, mode="r|*") as tar:
        for info in tar:
            if info.name not in wanted or not info.isfile():
                continue
            if info.size > opts.max_bytes:
                out[info.name] = Thumb(note=f"InputError: {info.size} bytes, over the thumbnail limit")
            else:
                member = tar.extractfile(info)
                out[info.name] = member.read() if member is not None else b""
            if len(out) == len(wanted):
                break
    return out


def _parquet_rows(file: str, wanted: set[str], opts: ThumbOptions) -> dict[str, bytes | Thumb]:
    """The wanted rows' media bytes of one Parquet manifest (one row group read per row)."""
    import pyarrow.parquet as pq

    fs, path = filesystem(file, opts.storage)
    out: dict[str, bytes | Thumb] = {}
    with open_input(fs, path, opts.storage) as f:
        pf = pq.ParquetFile(f)
        col = opts.media_column or next((fl.name for fl in pf.schema_arrow if _holds_bytes(fl.type)), None)
        if col is None:
            raise MediaError(f"{file} has no column of embedded media bytes")
        starts = np.cumsum([0] + [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])
        for row in sorted(wanted, key=int):
            g = int(np.searchsorted(starts, int(row), side="right")) - 1
            if not 0 <= g < pf.num_row_groups:
                continue
            cell = pf.read_row_group(g, columns=[col]).column(0)[int(row) - int(starts[g])].as_py()
            blob = cell.get("bytes") if isinstance(cell, dict) else cell
            if blob is not None and len(blob) > opts.max_bytes:
                out[row] = Thumb(note=f"InputError: {len(blob)} bytes, over the thumbnail limit")
            elif blob is not None:
                out[row] = bytes(blob)
    return out


def _holds_bytes(t) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or (
        pa.types.is_struct(t) and t.get_field_index("bytes") >= 0)


def _thumb(data: bytes, kind: str | None, uri: str, opts: ThumbOptions) -> Thumb:
    from vlbatch.operators.media.load import media_type_of

    try:
        if (kind or media_type_of(posixpath.basename(uri), data[:16])) == "image":
            from vlbatch.operators.media.image import load_image

            return Thumb(frames=(_jpeg(load_image(data), opts.size, opts.quality),))
        return _strip(data, opts)
    except Exception as e:  # noqa: BLE001 - a preview: any failure is this medium's placeholder
        return placeholder(e)


def _strip(data: bytes, opts: ThumbOptions) -> Thumb:
    """A video's sampled frames (the run's sampling), `strip_frames` of them evenly picked."""
    from vlbatch.operators.media.worker import decode_video

    sampling = replace(opts.sampling, max_output_bytes=min(opts.sampling.max_output_bytes, opts.max_frame_bytes))
    clip = decode_video(data, sampling, backend=opts.backend, timeout_s=opts.timeout_s)
    n = len(clip.indices)
    if n == 0:
        raise InputError("the video gave no frames")
    pick = np.unique(np.linspace(0, n - 1, min(n, opts.strip_frames)).round().astype(int))
    times = clip.timestamps
    frames = tuple(replace(_jpeg(clip.frames[i], opts.strip_size, opts.quality), label=f"{times[i]:.1f} s")
                   for i in pick)
    return Thumb(frames=frames, note=f"{len(pick)} of the {n} frames the model saw")


def clip_frames(data: bytes, mids: list[float], opts: ThumbOptions) -> list[Frame]:
    """A clipped video's timeline (`clips`): for each clip's middle (`mids`, seconds in the source),
    the nearest of the frames the run's sampling takes from the whole video (one decode, bounded as a
    strip's), labelled with its own time; a frame nearest two clips is made once."""
    from vlbatch.operators.media.worker import decode_video

    sampling = replace(opts.sampling, max_output_bytes=min(opts.sampling.max_output_bytes, opts.max_frame_bytes))
    clip = decode_video(data, sampling, backend=opts.backend, timeout_s=opts.timeout_s)
    times = clip.timestamps
    if not len(times):
        raise InputError("the video gave no frames")
    made: dict[int, Frame] = {}
    for m in mids:
        i = int(np.abs(times - m).argmin())
        if i not in made:
            made[i] = replace(_jpeg(clip.frames[i], opts.strip_size, opts.quality), label=f"{times[i]:.1f} s")
    return [made[int(np.abs(times - m).argmin())] for m in mids]


def _jpeg(rgb: np.ndarray, size: int, quality: int) -> Frame:
    """[H, W, 3] uint8 -> a JPEG of at most `size` pixels on its long side."""
    from PIL import Image

    img = Image.fromarray(rgb)
    img.thumbnail((size, size), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, optimize=True)
    return Frame(jpeg=buf.getvalue(), width=img.width, height=img.height)
