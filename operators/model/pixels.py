"""uint8 levels -> normalised pixel values on the model's device (the processor's table, one gather).

The processor's normalisation is a fixed per-channel map of the 256 uint8 levels
(`Normalization.lut`, float32 `[C, 256]`, computed with the reference's own float32 ops).
Shipping the resized uint8 levels in the processor's block-major patch layout
(`patchify_into(..., lut=None)`) and looking them up here gives the float32 pixel values
bit for bit, with 4x fewer bytes between the CPU stage and the model.

A patch row is `[C, tp, p, p]` values, so column j of `[N, C*tp*p*p]` belongs to channel
`j // (tp*p*p)`. The lookup casts the table to the model's dtype first: a cast is
per element, so `cast(table)[x] == cast(table[x])`, the float32 lookup then the cast.

The pipeline ships one step less: the resized uint8 frames `[F, H, W, C]` themselves
(`frames_to_patches` is the block-major layout as a view + one copy, `normalize_frames`
the lookup and that copy, both on the model's device; on CPU float32 they are one compiled
pass, `ops/pixels_cpu.py`). The patch layout repeats a still image in every temporal slot,
so frames are half the bytes of uint8 patches for images (an eighth of float32) and the
CPU stage makes no layout copy at all.
"""
from __future__ import annotations

import numpy as np
import torch

from vlbatch.operators.errors import InputError
from vlbatch.operators.model.ops import pixels_cpu


def _check(patches_shape: tuple[int, ...], dtype_ok: bool, table_shape: tuple[int, ...]) -> None:
    if not dtype_ok or len(patches_shape) != 2:
        raise InputError(f"patches must be uint8 [N, D], got shape {patches_shape}")
    if len(table_shape) != 2 or table_shape[1] != 256 or patches_shape[1] % table_shape[0]:
        raise InputError(f"table must be [C, 256] with C dividing D={patches_shape[1]}, got {table_shape}")


def normalize_patches(patches: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """patches uint8 `[N, D]`, table `[C, 256]` (any float dtype, on the patches' device)
    -> `[N, D]` in the table's dtype: `out[n, j] = table[j // (D // C), patches[n, j]]`.

    One `index_select` over the flattened table with int32 indices `[N, D]` (the only
    temporary, the output's size in float32)."""
    _check(tuple(patches.shape), patches.dtype == torch.uint8, tuple(table.shape))
    n, d = patches.shape
    c = table.shape[0]
    base = (torch.arange(c, dtype=torch.int32, device=patches.device) * 256).repeat_interleave(d // c)  # [D]
    idx = patches.to(torch.int32) + base
    return table.reshape(-1).index_select(0, idx.reshape(-1)).view(n, d)


def frames_to_patches(frames: torch.Tensor, *, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """frames `[F, H, W, C]` (any dtype) -> `[N, C * temporal * p * p]` in the processor's
    block-major order (`patchify_into`): temporal group, 2x2 merge block, patch in block;
    an odd frame count repeats the last frame, a still image (F = 1) fills every slot.
    H and W must be multiples of `patch * merge`."""
    f, h, w, c = frames.shape
    _check_grid(h, w, patch, merge)
    x = frames.permute(0, 3, 1, 2)  # [F, C, H, W] view
    if f == 1:
        x = x.expand(temporal, -1, -1, -1)
    elif pad := -f % temporal:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // temporal, h // patch, w // patch
    x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, bh, bw, mh, mw, C, tp, p, p]
    return x.reshape(gt * gh * gw, c * temporal * patch * patch)


def normalize_frames(frames: torch.Tensor, table: torch.Tensor, *, patch: int, merge: int,
                     temporal: int) -> torch.Tensor:
    """uint8 frames `[F, H, W, C]`, table `[C, 256]` (on the frames' device) -> `[N, C*tp*p*p]`
    in the table's dtype, equal to `normalize_patches(patchify_into(frames, lut=None), table)`
    bit for bit: one compiled pass on CPU float32 (`ops/pixels_cpu.py`), else the torch twin."""
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != table.shape[0]:
        raise InputError(f"frames must be uint8 [F, H, W, {table.shape[0]}], got {tuple(frames.shape)} {frames.dtype}")
    _check((1, table.shape[0]), True, tuple(table.shape))
    _check_grid(frames.shape[1], frames.shape[2], patch, merge)
    if pixels_cpu.usable(frames, table):
        return pixels_cpu.normalize_frames_cpu(frames, table, patch=patch, merge=merge, temporal=temporal)
    return normalize_frames_torch(frames, table, patch=patch, merge=merge, temporal=temporal)


def normalize_frames_torch(frames: torch.Tensor, table: torch.Tensor, *, patch: int, merge: int,
                           temporal: int) -> torch.Tensor:
    """The twin of the compiled pass (any device and dtype): the lookup over the frames
    (`out[..., c] = table[c, x[..., c]]`, one `index_select`) then the layout copy."""
    base = torch.arange(table.shape[0], dtype=torch.int32, device=frames.device) * 256  # [C]
    idx = frames.to(torch.int32) + base
    values = table.reshape(-1).index_select(0, idx.reshape(-1)).view(frames.shape)
    return frames_to_patches(values, patch=patch, merge=merge, temporal=temporal)


def _check_grid(h: int, w: int, patch: int, merge: int) -> None:
    if h % (patch * merge) or w % (patch * merge):
        raise InputError(f"frame size {h}x{w} is not a multiple of patch*merge={patch * merge}")


def normalize_patches_naive(patches: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The reference for `normalize_patches`: numpy fancy indexing, channel by column."""
    _check(patches.shape, patches.dtype == np.uint8, table.shape)
    channel = np.arange(patches.shape[1]) // (patches.shape[1] // table.shape[0])  # [D]
    return table[channel[None, :], patches]
