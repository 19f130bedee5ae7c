"""From video bytes to a `VideoClip`: probe, sample, decode only the sampled frames.

Owns the decode plan shared by the in-process path and the worker process:
1. open the container with the chosen backend; `info.frames` is the number of
   frames present in the data (not the header's claim);
2. sample indices with `vlbatch.operators.media.sampling.sample_frame_indices` over those
   frames (so indices never exceed what exists: the clamp against decord #373);
3. stream the sampled frames; if the backend finds the stream shorter than the
   probe promised (or cannot read the file at all), PyAV decodes the file once to
   count the frames that really decode, the indices are re-sampled over that
   count, and decoding restarts with PyAV (a new `Plan` is emitted).

Memory bound (per video): the input bytes + the output `F x H x W x 3` bytes (refused
above `FrameSampling.max_output_bytes`, 8 GiB by default) + the
backend's working set (decord, TorchCodec: `chunk` = 8 frames; PyAV: one frame plus the
codec's reference frames, <= 16). Nothing scales with the video's length except
the packet index (16 bytes per frame).

Rotation: frames come out upright (the container's display matrix applied), as a
player shows them. transformers' loaders do not rotate; we do, because captions
should describe what a viewer sees.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import InputError
from vlbatch.operators.media.decoders import ShortVideo, VideoData, VideoInfo, get_decoder
from vlbatch.operators.media.sampling import sample_frame_indices
from vlbatch.operators.types import VideoClip


@dataclass(frozen=True)
class FrameSampling:
    """How to pick frames (the reference's semantics): `fps` or `num_frames`, never both.

    max_output_bytes: refuse (InputError, before decoding) a plan whose frames
    `F x H x W x 3` would exceed this many bytes; 768 frames of 4K are 19 GB.
    """

    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    max_output_bytes: int = 8 << 30

    def indices(self, info: VideoInfo) -> np.ndarray:
        """[F] int64 indices in the source's index space, within [0, info.frames)."""
        idx = sample_frame_indices(info.frames, info.fps, fps=self.fps, num_frames=self.num_frames,
                                   min_frames=self.min_frames, max_frames=self.max_frames)
        return np.clip(idx, 0, info.frames - 1)


DEFAULT_SAMPLING = FrameSampling()  # the reference's defaults: 2 fps, 4..768 frames


@dataclass(frozen=True)
class Plan:
    """What is about to be decoded: metadata, indices `[F]` and the output shape `(F, H, W, 3)`."""

    info: VideoInfo
    indices: tuple[int, ...]
    backend: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.indices), self.info.height, self.info.width, 3)

    def check(self, sampling: FrameSampling) -> Plan:
        """Raise `InputError` if the output would exceed `sampling.max_output_bytes`."""
        nbytes = int(np.prod(self.shape))
        if nbytes > sampling.max_output_bytes:
            f, h, w, _ = self.shape
            raise InputError(f"{f} sampled frames of {w}x{h} need {nbytes / 2**30:.1f} GiB, over the "
                             f"{sampling.max_output_bytes / 2**30:.1f} GiB limit; sample fewer frames")
        return self


def decode_stream(data: VideoData, sampling: FrameSampling, backend: str = "auto",
                  threads: int = 1) -> Iterator[Plan | tuple[int, np.ndarray]]:
    """Yield a `Plan`, then `(slot, frame [H, W, 3])` per sampled frame; a second `Plan` restarts the slots."""
    decoder = get_decoder(backend, threads)
    try:
        video = decoder.open(data)  # MediaError for non-videos; ShortVideo if only PyAV can read it
    except ShortVideo:
        video = None
    if video is not None:
        with video:
            plan = Plan(video.info, tuple(int(i) for i in sampling.indices(video.info)), decoder.name)
            yield plan.check(sampling)
            try:
                yield from enumerate(video.iter_frames(plan.indices))
                return
            except ShortVideo:
                pass
    yield from _recount_and_decode(data, sampling, threads)


def _recount_and_decode(data: VideoData, sampling: FrameSampling, threads: int):
    """Slow path for files cut short: PyAV counts frames that decode, then decodes the re-sampled set."""
    from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder

    with PyAVDecoder(threads).open(data) as video:
        info = video.recount()
        plan = Plan(info, tuple(int(i) for i in sampling.indices(info)), "pyav")
        yield plan.check(sampling)
        yield from enumerate(video.iter_frames(plan.indices))


def collect(stream: Iterator[Plan | tuple[int, np.ndarray]]) -> VideoClip:
    """Assemble a `decode_stream` into a `VideoClip` (frames preallocated once per plan)."""
    plan, frames = None, None
    for item in stream:
        if isinstance(item, Plan):
            plan, frames = item, np.empty(item.shape, np.uint8)
        else:
            slot, frame = item
            frames[slot] = frame
    return VideoClip(frames=frames, source_fps=plan.info.fps, total_frames=plan.info.frames, indices=plan.indices)


def decode_video_inprocess(data: VideoData, sampling: FrameSampling = DEFAULT_SAMPLING, backend: str = "auto",
                           threads: int = 1) -> VideoClip:
    """Decode in this process (no time limit: tests and benchmarks; production uses `DecodeWorker`)."""
    return collect(decode_stream(data, sampling, backend, threads))
