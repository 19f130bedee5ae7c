"""TorchCodec backend: FFmpeg through `torchcodec.decoders.VideoDecoder`, on the CPU or on CUDA (NVDEC).

Owns decoding with TorchCodec and the answer to "can TorchCodec run here?" (`torchcodec_problem`).

- Metadata and the count of frames present come from the shared PyAV packet scan
  (`probe_container`), as for decord, so every backend reports the same `VideoInfo` and
  samples the same indices; indices beyond it are never handed to TorchCodec.
- Frames are addressed by index in TorchCodec's exact seek mode (its own scan of the
  packets, presentation order): bit-identical to PyAV on the suite's media (B-frames,
  VFR, VP8 alt-ref, rotation; tests/test_media_torchcodec.py). Its approximate mode derives
  timestamps from the average rate and returns wrong frames on VFR files, so it is not used
  (bench_video_decode measures it, with its `ok` fraction).
- TorchCodec applies the display rotation itself (0.17); frames it returns in coded
  orientation are rotated here.
- Bytes are handed to TorchCodec as they are; a `MediaFile` as a file object it reads on demand.
- Frames are fetched `chunk` indices per call (memory: `chunk` decoded frames); TorchCodec keeps
  its position between calls and seeks only past the next keyframe. Any TorchCodec error mid-stream
  (a file cut short) raises `ShortVideo`, and the caller recounts with PyAV.

Installation: the wheel (`pip install torchcodec`, 0.12+ for torch >= 2.11) loads FFmpeg 4-8's
shared libraries from the system at first use; without them it imports but fails on first use.
`torchcodec_problem()` says which is missing in one line.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from vlbatch.operators.media.decoders.base import (
    OpenVideo,
    ShortVideo,
    VideoData,
    VideoDecoder,
    _short,
    media_stream,
    probe_bytes,
    run_chunks,
)

INSTALL_HINT = ("install FFmpeg's shared libraries (Debian 12: apt-get install libavcodec59 libavformat59 "
                "libavutil57 libavdevice59 libavfilter8 libswscale6 libswresample4; any FFmpeg 4-8) "
                "and pip install 'torchcodec>=0.12'")


def torchcodec_problem() -> str | None:
    """None if TorchCodec decodes here, else one line saying what to install."""
    try:
        import torchcodec  # noqa: F401
    except ImportError:
        return f"torchcodec is not installed: {INSTALL_HINT}"
    try:
        from torchcodec._core import ops
    except Exception as e:  # a wheel built for another torch fails here
        return f"torchcodec does not load ({_short(e, 120)}): {INSTALL_HINT}"
    if not getattr(ops, "_FFMPEG_AVAILABLE", True):
        return f"torchcodec finds no FFmpeg shared libraries: {INSTALL_HINT}"
    return None


class TorchcodecDecoder(VideoDecoder):
    """TorchCodec backend. threads: FFmpeg threads per video; chunk: indices per call;
    device: "cpu", or "cuda" / "cuda:N" (NVDEC; frames stay on that device: `open_tensors`)."""

    name = "torchcodec"

    def __init__(self, threads: int = 1, chunk: int = 8, device: str = "cpu"):
        self.threads = threads
        self.chunk = chunk
        self.device = device

    def open(self, data: VideoData) -> TorchcodecVideo:
        return TorchcodecVideo(data, self.threads, self.chunk, self.device)


class TorchcodecVideo(OpenVideo):
    def __init__(self, data: VideoData, threads: int, chunk: int, device: str):
        self.info = probe_bytes(data)
        from torchcodec.decoders import VideoDecoder as _TC

        try:
            source = data if isinstance(data, bytes) else media_stream(data)
            self.decoder = _TC(source, seek_mode="exact", dimension_order="NHWC", num_ffmpeg_threads=threads,
                               device=device)
        except Exception as e:  # RuntimeError with FFmpeg's text; PyAV parsed it, so let the caller fall back
            raise ShortVideo(f"torchcodec cannot open a video PyAV can read: {_short(e)}") from e
        self.chunk = max(1, chunk)

    def close(self) -> None:
        self.decoder = None

    def iter_tensors(self, indices) -> Iterator[tuple[list[int], object]]:
        """(repeat counts, frames `[c, H, W, 3]` uint8 torch tensor on the decoder's device) per chunk,
        upright; the unique indices of `indices` in order, `chunk` at a time."""
        for wanted, repeats in run_chunks(indices, self.chunk, self.info.frames):
            try:
                batch = self.decoder.get_frames_at(wanted).data  # [c, H, W, 3]
            except Exception as e:  # IndexError / RuntimeError from a stream shorter than its packets
                raise ShortVideo(f"torchcodec failed at frames {wanted[0]}..{wanted[-1]}: {_short(e)}") from e
            if tuple(batch.shape[1:3]) != (self.info.height, self.info.width):  # coded orientation
                batch = batch.rot90((self.info.rotation // 90) % 4, dims=(1, 2)).contiguous()
            yield repeats, batch

    def iter_frames(self, indices) -> Iterator[np.ndarray]:
        for repeats, batch in self.iter_tensors(indices):
            for repeat, frame in zip(repeats, batch.cpu().numpy(), strict=True):
                for _ in range(repeat):
                    yield frame
