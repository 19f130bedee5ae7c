"""Frozen data types passed between stages (Ray-free).

`VideoClip` is what a video decoder produces and the video processor consumes:
the sampled frames plus the metadata needed to keep timestamps true. `VideoPlan` is the
same without the frames (the deferred decode, `video.decode_device`): what the processor
needs to size the clip, place its tokens and timestamps before any frame is decoded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VideoClip:
    """Sampled frames of one video.

    frames:       [F, H, W, 3] uint8 RGB, the sampled frames in order.
    source_fps:   the container's frame rate (frames per second of the source).
    total_frames: the number of decodable frames in the source.
    indices:      [F] the sampled frames' indices in the source's index space.
    """

    frames: np.ndarray
    source_fps: float
    total_frames: int
    indices: tuple[int, ...]

    @property
    def timestamps(self) -> np.ndarray:
        """[F] seconds of each sampled frame in the source."""
        return np.asarray(self.indices, dtype=np.float64) / self.source_fps


@dataclass(frozen=True)
class VideoPlan:
    """The sampled frames of one video before decoding: `VideoClip`'s metadata and the
    upright source size (height, width) of every frame."""

    source_fps: float
    total_frames: int
    indices: tuple[int, ...]
    height: int
    width: int
