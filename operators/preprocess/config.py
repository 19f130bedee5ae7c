"""Processor settings read from a checkpoint's preprocessor_config.json / video_preprocessor_config.json.

Owns the mapping from the JSON fields transformers writes to small frozen
dataclasses. `size.shortest_edge` / `size.longest_edge` are pixel-area limits on
this path (seed 000 section 4.2); legacy top-level `min_pixels` / `max_pixels`
override them as transformers does. Missing fields take the reference
classes' defaults (Qwen2VLImageProcessor / Qwen3VLVideoProcessor).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.preprocess.patchify import Normalization
from vlbatch.operators.storage.named_file import checkpoint_text

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2VLImageProcessor's defaults
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class _Patching:
    """What image and video configs derive from their patch sizes (both have these fields)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int

    @property
    def factor(self) -> int:
        """Pixels per merged token side: resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def layout(self) -> tuple[int, int, int]:
        """(patch, merge, temporal): how resized frames become patches (`frames_to_patches`)."""
        return self.patch_size, self.merge_size, self.temporal_patch_size


@dataclass(frozen=True)
class ImageConfig(_Patching):
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    do_resize: bool = True
    norm: Normalization = field(default_factory=lambda: Normalization(image_mean=_CLIP_MEAN, image_std=_CLIP_STD))


@dataclass(frozen=True)
class VideoConfig(_Patching):
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    do_resize: bool = True
    cap_pixels_per_frame: bool = False  # the reference's `None` (uncapped, with a warning) is False here
    max_video_tokens: int = 768
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    norm: Normalization = field(default_factory=lambda: Normalization(image_mean=(0.5,) * 3, image_std=(0.5,) * 3))


def _norm(d: dict, default: Normalization) -> Normalization:
    return Normalization(
        do_rescale=bool(d.get("do_rescale", default.do_rescale)),
        rescale_factor=float(d.get("rescale_factor", default.rescale_factor)),
        do_normalize=bool(d.get("do_normalize", default.do_normalize)),
        image_mean=tuple(float(x) for x in d.get("image_mean", default.image_mean)),
        image_std=tuple(float(x) for x in d.get("image_std", default.image_std)),
    )


def _sizes(d: dict, min_default: int, max_default: int) -> tuple[int, int]:
    size = d.get("size") or {}
    lo = size.get("shortest_edge", size.get("min_pixels", min_default))
    hi = size.get("longest_edge", size.get("max_pixels", max_default))
    lo = d.get("min_pixels") if d.get("min_pixels") is not None else lo
    hi = d.get("max_pixels") if d.get("max_pixels") is not None else hi
    return int(lo), int(hi)


def _read(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(checkpoint_text(path))
    except ValueError as e:
        raise ConfigError(f"{path}: cannot read processor config: {e}") from e


def _grid_fields(d: dict, base: ImageConfig | VideoConfig) -> dict:
    """Fields image and video configs share: patch geometry, pixel budget, resize, normalisation."""
    lo, hi = _sizes(d, base.min_pixels, base.max_pixels)
    return dict(
        patch_size=int(d.get("patch_size", base.patch_size)),
        temporal_patch_size=int(d.get("temporal_patch_size", base.temporal_patch_size)),
        merge_size=int(d.get("merge_size", base.merge_size)),
        min_pixels=lo,
        max_pixels=hi,
        do_resize=bool(d.get("do_resize", True)),
        norm=_norm(d, base.norm),
    )


def load_image_config(model_dir: str | Path) -> ImageConfig:
    d = _read(Path(model_dir) / "preprocessor_config.json")
    base = ImageConfig()
    return ImageConfig(**_grid_fields(d, base))


def load_video_config(model_dir: str | Path) -> VideoConfig:
    path = Path(model_dir) / "video_preprocessor_config.json"
    d = _read(path) or _read(Path(model_dir) / "preprocessor_config.json")
    base = VideoConfig()
    return VideoConfig(
        **_grid_fields(d, base),
        cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame") or False),
        max_video_tokens=int(d.get("max_video_tokens", base.max_video_tokens)),
        fps=d.get("fps", base.fps),
        num_frames=d.get("num_frames"),
        min_frames=int(d.get("min_frames", base.min_frames)),
        max_frames=int(d.get("max_frames", base.max_frames)),
    )
