"""uint8 patches -> normalised pixel values on the model's device (the processor's table, one gather).

The processor's normalisation is a fixed per-channel map of the 256 uint8 levels
(`Normalization.lut`, float32 `[C, 256]`, computed with the reference's own float32 ops).
Shipping the resized uint8 levels in the processor's block-major patch layout
(`patchify_into(..., lut=None)`) and looking them up here gives the float32 pixel values
bit for bit, with 4x fewer bytes between the CPU stage and the model.

A patch row is `[C, tp, p, p]` values, so column j of `[N, C*tp*p*p]` belongs to channel
`j // (tp*p*p)`. The lookup casts the table to the model's dtype first: a cast is
per element, so `cast(table)[x] == cast(table[x])`, the float32 lookup then the cast.
"""
from __future__ import annotations

import numpy as np
import torch

from vlbatch.operators.errors import InputError


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


def normalize_patches_naive(patches: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The reference for `normalize_patches`: numpy fancy indexing, channel by column."""
    _check(patches.shape, patches.dtype == np.uint8, table.shape)
    channel = np.arange(patches.shape[1]) // (patches.shape[1] // table.shape[0])  # [D]
    return table[channel[None, :], patches]
