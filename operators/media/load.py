"""`load_media`: one entry point from a URI to pixels, for images and videos alike.

Owns the choice between image and video and the glue between storage
(`vlbatch.operators.storage.read_bytes`; a video `open_media`: its file handed to the decoder child,
its bytes held once), the image loader
(`vlbatch.operators.media.image.load_image`) and the killable video decoder
(`vlbatch.operators.media.worker`). Errors are the same typed ones everywhere:
`MediaError` (bad bytes, missing object), `MediaTimeoutError`, `StorageError`,
`InputError`.

Media type: the caller's `media_type` if given, else the file extension
(`media_type_from_extension`, the one table the manifest expansion uses too), else the
first bytes (JPEG / PNG / GIF / WebP / BMP / TIFF signatures mean image; anything else
is tried as video). `.m4a` is MPEG-4 *audio*: no video stream to caption, so it is in
neither table (a manifest row needs an explicit media_type for it; here its bytes are
tried as video, and an audio-only file fails to decode with `MediaError`).
"""
from __future__ import annotations

import os

import numpy as np

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.image import load_image
from vlbatch.operators.media.video import DEFAULT_SAMPLING, FrameSampling
from vlbatch.operators.media.worker import DecodeWorker, decode_video
from vlbatch.operators.storage import DEFAULT_STORAGE, StorageOptions, open_media, read_bytes
from vlbatch.operators.types import VideoClip

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".jfif"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".mpg", ".mpeg", ".flv",
                              ".3gp"})
AUDIO_EXTENSIONS = frozenset({".m4a", ".mp3", ".wav", ".aac", ".flac"})  # no picture: neither image nor video


def extension(uri: str) -> str:
    """The lower-case extension of `uri`'s last path segment ('' if none), query string ignored:
    `PurePosixPath(path).suffix` (its rule: a dot inside the name, not first, not last) without
    building the path object (~10x faster; every manifest row asks)."""
    path = uri.split("?", 1)[0]
    while path.endswith(("/", "/.")):  # pathlib drops a trailing slash and "." segments
        path = path[:-1] if path.endswith("/") else path[:-2]
    name = path.rsplit("/", 1)[-1]
    dot = name.rfind(".")
    return name[dot:].lower() if 0 < dot < len(name) - 1 else ""


def media_type_from_extension(uri: str) -> str | None:
    """'image' / 'video' from the extension of `uri`; None if unknown or audio (`AUDIO_EXTENSIONS`)."""
    ext = extension(uri)
    if ext in IMAGE_EXTENSIONS:
        return "image"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    return None


def folder_media(root: str, paths) -> list[str]:
    """The image and video files among `paths` (all under the folder `root`), sorted; entries whose
    path below `root` has a part starting with '.' or '_' are left out."""
    base = root.rstrip("/") + "/"
    keep = []
    for p in paths:
        rel = p[len(base):] if p.startswith(base) else p.rsplit("/", 1)[-1]
        if any(part.startswith((".", "_")) for part in rel.split("/")):
            continue
        if media_type_from_extension(p) is not None:
            keep.append(p)
    return sorted(keep)


def media_type_of(uri: str, head: bytes) -> str:
    """'image' or 'video' from the extension of `uri`, else from the signature in `head`."""
    by_ext = media_type_from_extension(uri)
    if by_ext is not None:
        return by_ext
    if head.startswith((b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"II*\x00", b"MM\x00*")):
        return "image"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image"
    return "video"


def load_media(
    uri: str,
    storage: StorageOptions = DEFAULT_STORAGE,
    *,
    media_type: str | None = None,
    sampling: FrameSampling = DEFAULT_SAMPLING,
    backend: str = "auto",
    timeout_s: float = 60.0,
    worker: DecodeWorker | None = None,
    max_bytes: int | None = None,
) -> np.ndarray | VideoClip:
    """An image `[H, W, 3]` uint8 or a `VideoClip` for the media at `uri`.

    Pass a long-lived `worker` when loading many videos (one child process reused).
    `max_bytes`: a larger file is an `InputError`, found before it is read (`read_bytes`).
    """
    if media_type not in (None, "image", "video"):
        got = repr(media_type) if isinstance(media_type, str) else type(media_type).__name__  # no object repr
        raise ConfigError(f"media_type must be 'image' or 'video', got {got}")
    kind = media_type or media_type_from_extension(uri)
    if kind == "image":
        return load_image(read_bytes(uri, storage, max_bytes=max_bytes))
    with open_media(uri, storage, max_bytes=max_bytes) as file:
        if kind is None and media_type_of(uri, os.pread(file.fd, 16, 0)) == "image":
            return load_image(file.read_all())
        return decode_video(file, sampling, backend=backend, timeout_s=timeout_s, worker=worker)
