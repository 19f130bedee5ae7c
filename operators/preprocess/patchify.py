"""Rescale + normalise, then patchify into block-major order (seed 000 sections 4.4 and 5.3).

Owns the layout of `pixel_values [N_patch, C * tp * p * p]` (1536 for C=3, tp=2,
p=16): rows ordered by temporal group, then 2x2 merge block (row-major over
blocks), then the patch inside the block (row-major); each row holds
`[C, tp, p, p]` values. Temporal slot t of group g is frame `min(g*tp + t, F-1)`,
so an odd frame count repeats the last frame and a still image (F = 1) fills
every slot with the same pixels.

Fast path (`patchify_into`): one compiled pass (numba) reads the uint8 frames in
their natural `[F, H, W, C]` layout and writes every output value exactly once
through a per-channel lookup table of the 256 possible results. The table is
computed by the reference's own float32 ops (`(float32(x) - mean/rescale) /
(std/rescale)`, the fused form transformers uses; `x * rescale` when only
rescaling), so the output is bit-identical to `patchify_naive`, a direct
transcription of the reference's float-first order, which the tests compare
against over odd shapes.

uint8 mode (`lut=None`, `_patchify_levels`): the resized uint8 levels in the same layout,
as numpy strided copies of each frame's 7-D view (no table: ~3x faster than the kernel,
which is bound by its per-value lookup); the pipeline ships these, 4x fewer bytes;
`vlbatch.operators.model.pixels.normalize_patches` with `Normalization.lut` turns them
into the float32 values bit for bit on the model's device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlbatch.operators.model.ops.pixels_cpu import patches_kernel


@dataclass(frozen=True)
class Normalization:
    """Per-channel affine applied to uint8 values (the processor config's fields)."""

    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The reference's arithmetic on uint8 `[..., C, H, W]` -> float32 (rescale fused into mean/std)."""
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32)
            std = torch.tensor(self.image_std, dtype=torch.float32)
            if self.do_rescale:
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            return (x.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        if self.do_rescale:
            return x * self.rescale_factor
        return x.to(torch.float32)

    def lut(self, channels: int = 3) -> np.ndarray:
        """float32 `[C, 256]`: the normalised value of every uint8 level, per channel."""
        levels = torch.arange(256, dtype=torch.uint8).view(1, 1, 256).expand(channels, 1, 256)
        return np.ascontiguousarray(self.apply(levels).reshape(channels, 256).numpy())


def grid_of(frames: int, height: int, width: int, patch: int, temporal: int) -> tuple[int, int, int]:
    """(t, h, w) patch grid of F frames of height x width (F padded up to a multiple of temporal)."""
    return -(-frames // temporal), height // patch, width // patch


def patchify_into(out: np.ndarray, frames: np.ndarray, lut: np.ndarray | None, *, patch: int, merge: int,
                  temporal: int) -> tuple[int, int, int]:
    """Write one image or clip into `out` `[N, C * temporal * p * p]`; return its grid (t, h, w).

    frames: uint8 `[F, H, W, C]`, H and W multiples of patch*merge (F = 1 for an image).
    lut: float32 `[C, 256]` (`Normalization.lut`) with a float32 `out`, or None with a uint8
    `out`: the levels themselves (through the identity table, same kernel, same layout).
    """
    f, h, w, c = frames.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"frame size {h}x{w} is not a multiple of patch*merge={patch * merge}; smart_resize first")
    grid = grid_of(f, h, w, patch, temporal)
    want = np.float32 if lut is not None else np.uint8
    if out.shape != (grid[0] * grid[1] * grid[2], c * temporal * patch * patch) or out.dtype != want:
        raise ValueError(f"out has shape {out.shape} {out.dtype}, expected {grid} patches of {np.dtype(want)}")
    if lut is None:
        _patchify_levels(out, frames, grid, patch=patch, merge=merge, temporal=temporal)
    else:
        patches_kernel(np.ascontiguousarray(frames), lut, out, patch, merge, temporal)
    return grid


def _patchify_levels(out: np.ndarray, frames: np.ndarray, grid: tuple[int, int, int], *, patch: int, merge: int,
                     temporal: int) -> None:
    """uint8 `[F, H, W, C]` -> `out` uint8 `[N, C*tp*p*p]`: per temporal group and slot, one strided
    copy of the source frame viewed `[bh, bw, mh, mw, C, p, p]`; a repeated frame copies the slot."""
    f, _, _, c = frames.shape
    gt, gh, gw = grid
    bh, bw = gh // merge, gw // merge
    per = gh * gw
    for g in range(gt):
        dst = out[g * per:(g + 1) * per].reshape(bh, bw, merge, merge, c, temporal, patch, patch)
        for t in range(temporal):
            src = min(g * temporal + t, f - 1)
            if t > 0 and src == min(g * temporal + t - 1, f - 1):
                dst[:, :, :, :, :, t] = dst[:, :, :, :, :, t - 1]
                continue
            view = frames[src].reshape(bh, merge, patch, bw, merge, patch, c).transpose(0, 3, 1, 4, 6, 2, 5)
            dst[:, :, :, :, :, t] = view


def patchify_naive(frames: torch.Tensor, norm: Normalization, *, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """Reference order of operations: float normalise whole frames, then view/permute (seed 000 4.4/5.3).

    frames uint8 `[F, C, H, W]`; returns float32 `[N, C * temporal * p * p]`. The layout is
    `frames_to_patches` (torch views), itself checked against the numpy uint8 mode.
    """
    from vlbatch.operators.model.pixels import frames_to_patches

    x = norm.apply(frames).permute(0, 2, 3, 1)  # [F, H, W, C] view
    return frames_to_patches(x, patch=patch, merge=merge, temporal=temporal)
