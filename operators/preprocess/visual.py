"""Images and video clips -> `pixel_values [N, C*tp*p*p]` float32 (or the uint8 levels in the
same layout, `uint8=True`; or one item's resized uint8 frames `[F, h, w, 3]`, `frames=True`)
and `grid_thw [M, 3]` int64.

Owns input validation of decoded media and the per-item resize + patchify loop.
Pixels stay in their decoded `[F, H, W, 3]` layout throughout: the resize op
reads and writes it as a channels-last tensor view (no transposing copies) and
the patchify kernel reads it directly. Each item is written straight into its
slice of one preallocated output, so there is no concatenation copy. Items are
processed one at a time; the reference groups equal shapes into one resize
call, which gives the same per-image result.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from vlbatch.operators.errors import InputError
from vlbatch.operators.media.sampling import group_timestamps
from vlbatch.operators.preprocess.config import ImageConfig, VideoConfig
from vlbatch.operators.preprocess.patchify import grid_of, patchify_into
from vlbatch.operators.preprocess.resize import (
    resize_frames,
    smart_resize_image,
    smart_resize_video,
    video_max_pixels,
)
from vlbatch.operators.types import VideoClip, VideoPlan


@dataclass(frozen=True)
class VisualBatch:
    """pixel_values float32 `[N, D]` (uint8 levels with `uint8=True`); grid_thw int64 `[M, 3]`;
    timestamps: per item, seconds per temporal group."""

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    timestamps: tuple[tuple[float, ...], ...] = ()


def _tensor(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only arrays (e.g. from PIL) are only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _check_pixels(arr, what: str, ndim: int) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != ndim or arr.shape[-1] != 3:
        shape = getattr(arr, "shape", None)
        dtype = getattr(arr, "dtype", type(arr).__name__)
        want = "[H, W, 3]" if ndim == 3 else "[F, H, W, 3]"
        raise InputError(f"{what} must be a uint8 RGB array {want}, got shape {shape} dtype {dtype}")
    if 0 in arr.shape:
        raise InputError(f"{what} has no pixels (shape {arr.shape})")


def _resized(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 `[F, H, W, 3]` -> `[F, h, w, 3]` with the reference's resize op (identity when equal)."""
    if frames.shape[1:3] == size:
        return frames
    t = _tensor(frames)
    if t.shape[0] == 1:  # numpy's new axis has stride 0; torch then picks a channels-first output
        t = t[0].unsqueeze(0)
    view = t.permute(0, 3, 1, 2)  # [F, 3, H, W] channels-last view, no copy
    return resize_frames(view, *size).permute(0, 2, 3, 1).numpy()


def _fill(out: np.ndarray, frames: np.ndarray, size: tuple[int, int], cfg,
          lut: np.ndarray | None) -> tuple[int, int, int]:
    return patchify_into(out, _resized(frames, size), lut, patch=cfg.patch_size, merge=cfg.merge_size,
                         temporal=cfg.temporal_patch_size)


def image_sizes(images: list[np.ndarray], cfg: ImageConfig) -> list[tuple[int, int]]:
    """Resized (h, w) of each image; validates the arrays."""
    sizes = []
    for i, img in enumerate(images):
        _check_pixels(img, f"image {i}", 3)
        h, w = img.shape[:2]
        if cfg.do_resize:
            h, w = smart_resize_image(h, w, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
        elif h % cfg.factor or w % cfg.factor:
            raise InputError(f"image {i}: {w}x{h} is not a multiple of {cfg.factor} and resizing is off")
        sizes.append((h, w))
    return sizes


def _frames_batch(frames: np.ndarray, size: tuple[int, int], cfg, stamps=()) -> VisualBatch:
    """One item's resized uint8 frames `[F, h, w, 3]` (the decoded array itself when no resize is
    needed) and its grid: the pipeline's form (`vlbatch.operators.model.pixels.normalize_frames`)."""
    resized = np.ascontiguousarray(_resized(frames, size))
    grid = grid_of(resized.shape[0], *size, cfg.patch_size, cfg.temporal_patch_size)
    return VisualBatch(resized, np.asarray([grid], dtype=np.int64), stamps)


def _one(items: list, what: str) -> None:
    if len(items) != 1:
        raise ValueError(f"frames=True takes exactly one {what}, got {len(items)}")


def process_images(images: list[np.ndarray], cfg: ImageConfig, lut: np.ndarray | None = None, *,
                   uint8: bool = False, frames: bool = False) -> VisualBatch:
    """uint8 `[H, W, 3]` images -> pixel_values `[sum N_i, C*tp*p*p]`, image_grid_thw `[M, 3]`.

    lut: `cfg.norm.lut(3)`, passed in by callers that process many items.
    uint8: keep the resized levels (uint8, same layout; `lut` unused).
    frames: one image only; pixel_values are its resized levels `[1, h, w, 3]` (no patch layout).
    """
    sizes = image_sizes(images, cfg)
    if frames:
        _one(images, "image")
        return _frames_batch(images[0][None], sizes[0], cfg)
    p, tp = cfg.patch_size, cfg.temporal_patch_size
    counts = [(h // p) * (w // p) for h, w in sizes]
    out = np.empty((sum(counts), 3 * tp * p * p), dtype=np.uint8 if uint8 else np.float32)
    lut = None if uint8 else cfg.norm.lut(3) if lut is None else lut
    grids, off = [], 0
    for img, size, n in zip(images, sizes, counts, strict=True):
        grids.append(_fill(out[off:off + n], img[None], size, cfg, lut))
        off += n
    return VisualBatch(out, np.asarray(grids, dtype=np.int64).reshape(-1, 3))


def _check_clip(i: int, clip: VideoClip) -> None:
    if not isinstance(clip, VideoClip):
        raise InputError(f"video {i} must be a VideoClip, got {type(clip).__name__}")
    _check_pixels(clip.frames, f"video {i} frames", 4)
    if len(clip.indices) != clip.frames.shape[0]:
        raise InputError(f"video {i}: {clip.frames.shape[0]} frames but {len(clip.indices)} sampled indices")
    if not clip.total_frames or clip.total_frames <= 0:
        raise InputError(f"video {i}: metadata says the video has no frames (total_frames={clip.total_frames})")
    if not (clip.source_fps and np.isfinite(clip.source_fps) and clip.source_fps > 0):
        raise InputError(f"video {i}: frame rate must be positive, got source_fps={clip.source_fps!r}")


def video_size(i: int, clip: VideoClip | VideoPlan, cfg: VideoConfig) -> tuple[int, int]:
    """Resized (h, w) of a validated clip (or of a plan's frames, `plan_video`). A clip of fewer frames
    than the temporal patch size (one frame) is sized as the clip padded to it: patchify repeats its last
    frame as it does for any count not a multiple (the reference's `patchify`), so its tensors are the
    reference's for that padded clip (the reference's own resize refuses fewer frames)."""
    f, h, w = ((len(clip.indices), clip.height, clip.width) if isinstance(clip, VideoPlan)
               else clip.frames.shape[:3])
    f = max(f, cfg.temporal_patch_size)
    if not cfg.do_resize:
        return h, w
    budget = video_max_pixels(f, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                              cap_pixels_per_frame=cfg.cap_pixels_per_frame, max_video_tokens=cfg.max_video_tokens)
    try:
        return smart_resize_video(f, h, w, temporal_factor=cfg.temporal_patch_size, factor=cfg.factor,
                                  min_pixels=cfg.min_pixels, max_pixels=budget)
    except InputError as e:
        raise InputError(f"video {i}: {e}") from None


def process_videos(clips: list[VideoClip], cfg: VideoConfig, lut: np.ndarray | None = None, *,
                   uint8: bool = False, frames: bool = False) -> VisualBatch:
    """Sampled clips -> pixel_values_videos `[sum N_i, D]`, video_grid_thw `[M, 3]`, group timestamps
    (`lut`, `uint8`, `frames` as in `process_images`: one clip's `[F, h, w, 3]`)."""
    for i, clip in enumerate(clips):
        _check_clip(i, clip)
    sizes = [video_size(i, c, cfg) for i, c in enumerate(clips)]
    if frames:
        _one(clips, "video")
        stamps = (tuple(group_timestamps(clips[0].indices, clips[0].source_fps, cfg.temporal_patch_size)),)
        return _frames_batch(clips[0].frames, sizes[0], cfg, stamps)
    p, tp = cfg.patch_size, cfg.temporal_patch_size
    counts = [-(-c.frames.shape[0] // tp) * (h // p) * (w // p) for c, (h, w) in zip(clips, sizes, strict=True)]
    out = np.empty((sum(counts), 3 * tp * p * p), dtype=np.uint8 if uint8 else np.float32)
    lut = None if uint8 else cfg.norm.lut(3) if lut is None else lut
    grids, stamps, off = [], [], 0
    for clip, size, n in zip(clips, sizes, counts, strict=True):
        grids.append(_fill(out[off:off + n], clip.frames, size, cfg, lut))
        stamps.append(tuple(group_timestamps(clip.indices, clip.source_fps, tp)))
        off += n
    return VisualBatch(out, np.asarray(grids, dtype=np.int64).reshape(-1, 3), tuple(stamps))


def plan_video(plan: VideoPlan, cfg: VideoConfig) -> tuple[tuple[int, int], VisualBatch]:
    """A video's resized (h, w) and its grid `[1, 3]` and group timestamps, from its plan alone:
    what `process_videos(..., frames=True)` gives for the decoded clip, without its frames
    (`VisualBatch.pixel_values` is empty `[0, h, w, 3]`; the model stage decodes and resizes them,
    `operators/preprocess/shipped.py`)."""
    if not plan.indices or plan.height <= 0 or plan.width <= 0:
        raise InputError(f"video plan has no frames to sample ({len(plan.indices)} indices, "
                         f"{plan.width}x{plan.height})")
    if not (plan.total_frames and plan.total_frames > 0 and plan.source_fps and np.isfinite(plan.source_fps)
            and plan.source_fps > 0):
        raise InputError(f"video: bad metadata (total_frames={plan.total_frames}, source_fps={plan.source_fps!r})")
    size = video_size(0, plan, cfg)
    grid = grid_of(len(plan.indices), *size, cfg.patch_size, cfg.temporal_patch_size)
    stamps = (tuple(group_timestamps(plan.indices, plan.source_fps, cfg.temporal_patch_size)),)
    return size, VisualBatch(np.zeros((0, *size, 3), np.uint8), np.asarray([grid], dtype=np.int64), stamps)
