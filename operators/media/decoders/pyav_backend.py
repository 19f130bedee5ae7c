"""PyAV (FFmpeg) backend: seek to the keyframe before each wanted frame, decode forward.

Owns the second decoder: the cross-check for decord and the fallback that
counts the frames that really decode when a file is cut short.

Access pattern: frames are addressed by presentation timestamp from the packet
scan (`PacketIndex`), so the index space is the player's even with B-frames and
variable frame rate. For each wanted frame the decoder keeps going forward if
the frame lies before the next keyframe, else seeks to the keyframe at or before
it. Memory: one decoded frame plus FFmpeg's reference frames (bounded by the
codec's DPB, <= 16 frames), never the whole file.
Damaged packets are skipped (FFmpeg conceals what it can); a stream that ends
before a wanted frame raises `ShortVideo`.

Sparse sampling (`skip_nonref`, on by default): between wanted frames, H.264 pictures that no other
picture references (nal_ref_idc 0: most B-frames) are not decoded at all (FFmpeg's
`skip_frame = NONREF`, switched per packet by its timestamp). By the standard such a picture is never
used for prediction, so every other frame decodes bit-identically (tests/test_media_torchcodec.py
checks it against a full decode); a wanted picture is always decoded. Only H.264, and only with one
decoding thread (frame threads would see the switch late); HEVC's "sub-layer non-reference" pictures
may still be referenced by higher sub-layers, so HEVC decodes everything.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from vlbatch.operators.errors import MediaError
from vlbatch.operators.media.decoders.base import (
    OpenVideo,
    PacketIndex,
    ShortVideo,
    VideoData,
    VideoDecoder,
    VideoInfo,
    _short,
    open_container,
    probe_container,
    scan_packets,
    unique_runs,
    upright,
)


class PyAVDecoder(VideoDecoder):
    """PyAV backend. threads: FFmpeg decoding threads per video (1: parallelism comes from workers)."""

    name = "pyav"

    def __init__(self, threads: int = 1, skip_nonref: bool = True):
        self.threads = threads
        self.skip_nonref = skip_nonref

    def open(self, data: VideoData) -> PyAVVideo:
        return PyAVVideo(data, self.threads, self.skip_nonref)


SKIP_NONREF_CODECS = ("h264",)  # codecs whose non-reference pictures are never referenced (see above)


class PyAVVideo(OpenVideo):
    def __init__(self, data: VideoData, threads: int, skip_nonref: bool = True):
        import av

        self._av = av
        self._wanted: frozenset[int] = frozenset()  # pts that must be decoded; empty: decode everything
        self.decoded = 0  # pictures the codec returned (observable by tests and benchmarks)
        self.container, self.stream = open_container(data)
        try:
            self.index: PacketIndex = scan_packets(self.container, self.stream)
            if self.index.pts.size == 0:
                raise MediaError("the video stream holds no frames")
            cc = self.stream.codec_context
            cc.thread_count = threads
            if threads > 1:
                cc.thread_type = "AUTO"
            self._rewind(int(self.index.pts[0]))
            first = next(self._frames(), None)
            if first is None:
                raise MediaError("no frame of the video stream could be decoded")
            self.info = probe_container(self.container, self.stream, self.index, first)
            self._skip = skip_nonref and threads <= 1 and cc.name in SKIP_NONREF_CODECS
        except BaseException:
            self.container.close()
            raise
        self._gen = None  # rewound on first use

    def close(self) -> None:
        self.container.close()

    def _rewind(self, pts: int) -> None:
        self.container.seek(pts, stream=self.stream, backward=True, any_frame=False)
        self._gen = self._frames()

    def _frames(self) -> Iterator:
        """Decoded frames in presentation order from the current position, skipping damaged packets."""
        av = self._av
        packets = self.container.demux(self.stream)
        while True:
            try:
                packet = next(packets)
            except (StopIteration, av.FFmpegError, OSError):
                return  # end of data, or the data was cut inside a packet
            if self._wanted:
                self._set_skip(packet.pts is not None and packet.pts not in self._wanted)
            try:
                frames = packet.decode()
            except av.FFmpegError:
                continue  # a damaged packet: skip it, the decoder conceals what it can
            self.decoded += len(frames)
            yield from frames

    def _set_skip(self, skip: bool) -> None:
        """Decode (False) or drop (True) the next packet's picture if it is a non-reference one."""
        cc = self.stream.codec_context
        mode = "NONREF" if skip else "DEFAULT"
        if cc.skip_frame != mode:
            cc.skip_frame = mode

    def _to_rgb(self, frame) -> np.ndarray:
        return upright(frame.to_ndarray(format="rgb24"), self.info.rotation)

    def stream_all(self) -> Iterator:
        """Every picture that decodes, as PyAV frames in presentation order from the first
        (nothing skipped; damaged packets left out): the clip decode's one pass
        (`operators/media/clip_decode.py`). `to_rgb(frame)` makes one upright `[H, W, 3]` uint8."""
        self._wanted = frozenset()
        self._set_skip(False)
        self._rewind(int(self.index.pts[0]))
        return self._gen

    def to_rgb(self, frame) -> np.ndarray:
        return self._to_rgb(frame)

    def iter_frames(self, indices) -> Iterator[np.ndarray]:
        pts, keys = self.index.pts, self.index.keyframe_pts
        pos = None  # pts of the last decoded frame in the current run
        runs = unique_runs(indices)
        if self._skip and all(0 <= i < self.info.frames for i, _ in runs):
            self._wanted = frozenset(int(pts[i]) for i, _ in runs)
        for i, repeat in runs:
            if not 0 <= i < self.info.frames:
                raise IndexError(f"frame {i} outside [0, {self.info.frames})")
            target = int(pts[i])
            k = np.searchsorted(keys, target, side="right") - 1
            key = int(keys[k]) if k >= 0 else int(pts[0])
            if self._gen is None or pos is None or pos >= target or key > pos:
                self._rewind(key)
            frame, pos = self._advance_to(target)
            rgb = self._to_rgb(frame)
            for _ in range(repeat):
                yield rgb

    def _advance_to(self, target: int):
        """Decode forward to the frame with pts `target`; return (frame, its pts)."""
        for frame in self._gen:
            t = frame.pts
            if t is None or t < target:
                continue
            if t == target:
                return frame, t
            # Overshot (the seek landed after the target): decode from the start once.
            self._rewind(int(self.index.pts[0]))
            for frame2 in self._gen:
                if frame2.pts == target:
                    return frame2, target
            break
        raise ShortVideo(f"the stream ended before the frame at pts {target}")

    def recount(self) -> VideoInfo:
        """Decode the whole stream once and keep only frames that really decode (slow path for cut files).

        Rebuilds the index from the decoded frames' timestamps and returns the
        updated `info` (fewer `frames`); raises `MediaError` if nothing decodes.
        """
        self._wanted = frozenset()  # count every picture: nothing skipped
        self._set_skip(False)
        try:
            self._rewind(int(self.index.pts[0]))
            seen = np.asarray([f.pts for f in self._gen if f.pts is not None], dtype=np.int64)
        except self._av.FFmpegError as e:
            raise MediaError(f"the video stream cannot be decoded: {_short(e)}") from e
        if seen.size == 0:
            raise MediaError("no frame of the video stream could be decoded")
        seen = np.unique(seen)
        keys = self.index.keyframe_pts
        self.index = PacketIndex(seen, keys[keys <= seen[-1]])
        self.info = replace(self.info, frames=int(seen.size), duration_s=seen.size / self.info.fps)
        self._gen = None
        return self.info
