"""The video decoder interface and the container probe both backends share.

Contract of a `VideoDecoder` backend (decord, PyAV, or a test double):

- `open(data) -> OpenVideo` parses the container held in `data` (`VideoData`: bytes of a whole
  file, or a `MediaFile`: a descriptor the decoder reads through `media_stream(data)`, so the
  decoder child never holds a copy of the file) and returns an open video whose `info` is a `VideoInfo`; it raises
  `MediaError` for bytes that are not a video with at least one decodable frame
  (zero bytes, truncated header, audio only, unknown format).
- `OpenVideo.iter_frames(indices)` yields one upright RGB frame `[H, W, 3]` uint8
  per entry of `indices` (`[F]` non-decreasing ints in `[0, info.frames)`, repeats
  allowed), in order. Frames are in the source's presentation-order index space:
  index `i` is the i-th frame a player shows. Display rotation (the container's
  display matrix) is applied, so `H, W = info.height, info.width`.
- A backend decodes only what the indices need and holds at most a small constant
  number of decoded frames besides the one it yields (no whole-file arrays).
- If the stream ends or breaks before an index is reached (the header promised
  more than the data holds), it raises `ShortVideo`; the caller re-samples over
  the frames that really decode (`vlbatch.operators.media.video`).
- A backend never hangs by design, but one may (decord's native loop): callers run
  backends in a killable process (`vlbatch.operators.media.worker`), never trusting them.

`probe_container` is the shared metadata reader (PyAV, demux only, no decoding
except the first frame): fps, header frame count, the frames actually present,
duration, size and rotation.
"""
from __future__ import annotations

import io
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import MediaError, stable_message
from vlbatch.operators.storage.media_file import MediaFile

VideoData = bytes | MediaFile  # what a backend opens: the whole file's bytes, or its descriptor


def media_stream(data: VideoData) -> io.RawIOBase | io.BytesIO:
    """A fresh seekable binary file over `data` (its own position): FFmpeg reads it through its
    callbacks, as it reads bytes in memory, never opening a path or URL itself."""
    return data.reader() if isinstance(data, MediaFile) else io.BytesIO(data)


def data_size(data: VideoData) -> int:
    return data.size if isinstance(data, MediaFile) else len(data)


@dataclass(frozen=True)
class VideoInfo:
    """Container metadata of one video (sizes upright, i.e. after rotation).

    fps: average frame rate (frames / duration, as `av` `average_rate` and decord's
    `get_avg_fps`); frames: frames present in the data (<= header_frames when the
    file is cut short); header_frames: what the container claims (None if it
    stores no count, e.g. Matroska); duration_s: frames / fps; rotation: display
    rotation in degrees counter-clockwise, one of 0, 90, 180, 270.
    """

    fps: float
    frames: int
    header_frames: int | None
    duration_s: float
    width: int
    height: int
    rotation: int
    codec: str


class ShortVideo(Exception):
    """The stream ended or broke before a requested index, or the backend cannot read a file that the
    container probe accepted. Internal: `vlbatch.operators.media.video` recounts with PyAV and never lets it escape."""


class OpenVideo(ABC):
    """One opened video; use as a context manager."""

    info: VideoInfo

    @abstractmethod
    def iter_frames(self, indices) -> Iterator[np.ndarray]:
        """Yield `[H, W, 3]` uint8 upright frames for `indices` ([F] non-decreasing)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release native resources."""

    def __enter__(self) -> OpenVideo:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VideoDecoder(ABC):
    """A decoding backend (see the module docstring for the contract)."""

    name: str = "abstract"

    @abstractmethod
    def open(self, data: VideoData) -> OpenVideo:
        """Parse `data`; raise `MediaError` if it is not a decodable video."""

    def probe(self, data: VideoData) -> VideoInfo:
        with self.open(data) as video:
            return video.info

    def decode(self, data: VideoData, indices) -> np.ndarray:
        """`[F, H, W, 3]` uint8 frames for `indices` (convenience; streams are preferred)."""
        with self.open(data) as video:
            return np.stack(list(video.iter_frames(indices)))


def unique_runs(indices) -> list[tuple[int, int]]:
    """Non-decreasing `indices` [F] -> [(index, repeat count)]; raises ValueError if they decrease."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and np.any(np.diff(idx) < 0):
        raise ValueError("frame indices must be non-decreasing")
    values, counts = np.unique(idx, return_counts=True)
    return list(zip(values.tolist(), counts.tolist(), strict=True))


def run_chunks(indices, chunk: int, frames: int) -> Iterator[tuple[list[int], list[int]]]:
    """Non-decreasing `indices` [F] -> (unique indices, their repeat counts) `chunk` runs at a time,
    for decoders that fetch a batch of frames per call; raises IndexError for an index outside
    [0, frames) before anything of that chunk is read."""
    runs = unique_runs(indices)
    for s in range(0, len(runs), chunk):
        wanted, repeats = (list(c) for c in zip(*runs[s:s + chunk], strict=True))
        if wanted[0] < 0 or wanted[-1] >= frames:
            raise IndexError(f"frame indices outside [0, {frames})")
        yield wanted, repeats


def upright(frame: np.ndarray, rotation: int) -> np.ndarray:
    """Apply a counter-clockwise display rotation to a coded [H, W, 3] frame."""
    k = (rotation // 90) % 4
    return np.ascontiguousarray(np.rot90(frame, k)) if k else frame


@dataclass(frozen=True)
class PacketIndex:
    """Presentation-ordered timestamps of the video packets present in the data.

    pts: [N] sorted presentation timestamps (stream time base), one per frame;
    keyframe_pts: [K] sorted timestamps of keyframes (seek points).
    """

    pts: np.ndarray
    keyframe_pts: np.ndarray


def open_container(data: VideoData):
    """`av.open` over a video's bytes or file (`media_stream`), mapping every failure to `MediaError`;
    returns (container, video stream)."""
    import av

    if not data_size(data):
        raise MediaError("the video file is empty (0 bytes)")
    try:
        container = av.open(media_stream(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError) as e:
        raise MediaError(f"not a readable video container: {_short(e)}") from e
    fmt = container.format.name
    if fmt.endswith("_pipe") or fmt in ("image2", "gif", "apng"):
        container.close()
        raise MediaError(f"the file is an image ({fmt.removesuffix('_pipe')}), not a video; load it as an image")
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        container.close()
        raise MediaError(f"the file has no video stream (streams: {', '.join(kinds)}); audio-only or not a video")
    return container, container.streams.video[0]


def scan_packets(container, stream) -> PacketIndex:
    """Demux (no decoding) every video packet present; stops at the first damaged packet."""
    import av

    pts, keys = [], []
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue  # the demuxer's end-of-stream marker
            if packet.is_corrupt:
                break  # a partial read: the file was cut here
            if packet.is_discard:
                continue  # dropped by an edit list: the decoder never shows it
            t = packet.pts if packet.pts is not None else packet.dts
            if t is None:
                continue
            pts.append(t)
            if packet.is_keyframe:
                keys.append(t)
    except (av.FFmpegError, OSError):
        pass  # truncated data: what was read so far is what exists
    return PacketIndex(np.sort(np.asarray(pts, dtype=np.int64)), np.sort(np.asarray(keys, dtype=np.int64)))


def probe_container(container, stream, index: PacketIndex, first_frame) -> VideoInfo:
    """Build `VideoInfo` from the stream header, the packet scan and the first decoded frame."""
    frames = int(index.pts.size)
    header = int(stream.frames) if stream.frames else None
    if header is not None:
        frames = min(frames, header)
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    if not fps > 0:
        raise MediaError("the video stream has no frame rate")
    rotation = int(round(getattr(first_frame, "rotation", 0) or 0)) % 360
    if rotation % 90:
        raise MediaError(f"unsupported display rotation of {rotation} degrees (only multiples of 90)")
    w, h = stream.codec_context.width, stream.codec_context.height
    if rotation in (90, 270):
        w, h = h, w
    return VideoInfo(fps=fps, frames=frames, header_frames=header, duration_s=frames / fps,
                     width=int(w), height=int(h), rotation=rotation, codec=stream.codec_context.name)


def probe_bytes(data: VideoData) -> VideoInfo:
    """`VideoInfo` of a video's bytes or file by the shared PyAV probe (packet scan + first frame): what every
    backend that decodes with another library reports, so all agree on frames, fps and rotation."""
    container, stream = open_container(data)
    try:
        index = scan_packets(container, stream)
        if index.pts.size == 0:
            raise MediaError("the video stream holds no frames")
        container.seek(int(index.pts[0]), stream=stream, backward=True)
        first = next(container.decode(stream), None)
        if first is None:
            raise MediaError("no frame of the video stream could be decoded")
        return probe_container(container, stream, index, first)
    except MediaError:
        raise
    except Exception as e:  # an FFmpeg error while decoding the first frame
        raise MediaError(f"the video stream cannot be decoded: {_short(e)}") from e
    finally:
        container.close()


def _short(e: BaseException, limit: int = 200) -> str:
    """`e`'s message on one line, without object addresses, cut at `limit`. An FFmpeg error reads
    as its reason and FFmpeg's last log line, without the errno and the '<none>' file name that
    in-memory input gets."""
    strerror, log = getattr(e, "strerror", None), getattr(e, "log", None)
    if strerror and hasattr(e, "log"):  # av.FFmpegError
        last = log[-1] if isinstance(log, tuple) and log else log
        text = f"{strerror} ({str(last).strip()})" if last else strerror
    else:
        text = str(e)
    text = stable_message(text.replace("\n", " "))
    return text if len(text) <= limit else text[:limit] + "..."
