"""Video frame sampling and per-temporal-group timestamps.

Owns the choice of which source frames a video contributes and the seconds
printed before each temporal group of the prompt. Both reproduce transformers
5.23 exactly: `Qwen3VLVideoProcessor.sample_frames` (indices) and
`Qwen3VLProcessor._calculate_timestamps` (timestamps).

Sampling rule (indices in the source video's index space):
- by fps: `n = int(total / source_fps * fps)`, clamped to `[min_frames, max_frames]`
  and then to `total`;
- by num_frames: `n = num_frames` exactly (no clamping, as in the reference; a
  count above `total` repeats frames);
- neither given: fps sampling at `DEFAULT_FPS` (the reference's default, 2);
- indices = `round(linspace(0, total - 1, n))` (numpy round-half-to-even).
A missing source fps is taken as 24, the reference's fallback.
"""
from __future__ import annotations

import math

import numpy as np

from vlbatch.operators.errors import InputError

DEFAULT_FPS = 2.0
FALLBACK_SOURCE_FPS = 24.0  # what the reference assumes when the container has no frame rate


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise InputError(f"{name} must be a positive number, got {value!r}")


def sample_frame_indices(
    total_frames: int,
    source_fps: float | None,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    min_frames: int = 4,
    max_frames: int = 768,
) -> np.ndarray:
    """Indices `[F] int64` of the frames to decode, identical to the reference's sampling.

    Raises `InputError` for both `fps` and `num_frames`, a non-positive fps,
    source fps or num_frames, or a video without frames.
    """
    if fps is not None and num_frames is not None:
        raise InputError("fps and num_frames are mutually exclusive: give one way of sampling frames, not both")
    if isinstance(total_frames, bool) or not isinstance(total_frames, (int, np.integer)) or total_frames <= 0:
        raise InputError(f"the video has no decodable frames (total_frames={total_frames!r})")
    total = int(total_frames)
    if num_frames is not None:
        if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or num_frames <= 0:
            raise InputError(f"num_frames must be a positive integer, got {num_frames!r}")
        n = int(num_frames)
    else:
        fps = DEFAULT_FPS if fps is None else fps
        _check_positive("fps", fps)
        src = FALLBACK_SOURCE_FPS if source_fps is None else source_fps
        _check_positive("the video's frame rate (source fps)", src)
        n = int(total / src * fps)  # same float expression order as the reference
        n = min(max(n, min_frames), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def group_timestamps(indices, source_fps: float | None, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal group: mean of its first and last frame time.

    `indices` [F] sampled source indices; an F not divisible by the temporal
    patch size is padded by repeating the last index (as the frames are).
    Returns `ceil(F / temporal_patch_size)` floats, printed as `<{t:.1f} seconds>`.
    """
    src = FALLBACK_SOURCE_FPS if source_fps is None else source_fps
    _check_positive("the video's frame rate (source fps)", src)
    idx = [int(i) for i in indices]
    if not idx:
        raise InputError("a video needs at least one sampled frame")
    if len(idx) % temporal_patch_size:
        idx.extend([idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size))
    t = [i / src for i in idx]
    return [(t[g] + t[g + temporal_patch_size - 1]) / 2 for g in range(0, len(t), temporal_patch_size)]
