"""Full attention's q / k RMSNorm + partial MRoPE on the CPU as one compiled pass (numba).

Same contract as `norm_rope_torch` (the twin: `apply_partial_rope(rms_norm_torch(x))`; every
other device and dtype takes it): x [T, H, D] (any strides inside a row of heads' first two
dims, unit stride over D), zero-centred weight [D], cos / sin [T, R] (R <= D, rotate_half
layout) -> [T, H, D] float32:

    n = x / sqrt(mean(x^2) + eps) * (1 + w)
    out[:R/2] = n[:R/2] cos - n[R/2:R] sin;  out[R/2:R] = n[R/2:R] cos + n[:R/2] sin;  out[R:] = n[R:]

The torch forms make ~10 passes (the norm's, then slices, rotate_half's neg and cat, two
multiplies, an add, the last cat); here a head row is read twice and written once. The sum
of squares is vectorised (reassociated): the norm differs from torch's in the last bits
(tested within 1e-6, tests/test_model_heads_cpu.py); the rotation is the same arithmetic.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from vlbatch.operators.model.ops.cpu import cpu_float32
from vlbatch.operators.model.ops.norm import rms_norm_torch
from vlbatch.operators.model.rope import apply_partial_rope


def norm_rope_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """The twin: x [T, H, D], weight [D], cos / sin [T, R] -> [T, H, D]."""
    return apply_partial_rope(rms_norm_torch(x, weight, eps), cos, sin)


def usable(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """CPU float32, unit stride over D (the kernel reads numpy views)."""
    return cpu_float32(x, weight, cos, sin) and x.stride(-1) == 1


def warm_up() -> None:
    """Load (or compile and cache) the kernel at model load (its input is always one flat
    contiguous array, so one compiled form serves every stride of q's chunk)."""
    cos = sin = torch.zeros(2, 2)
    norm_rope_cpu(torch.zeros(2, 1, 8).chunk(2, dim=-1)[0], torch.zeros(4), 1e-6, cos, sin)


def norm_rope_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """As `norm_rope_torch`, one compiled pass; the result contiguous. x (unit stride over D;
    q is a chunk of the fused q | gate projection) reaches the kernel as one flat array and
    its two outer strides, so the loops along D have unit stride and vectorise."""
    t, nh, d = x.shape
    out = torch.empty(x.shape, dtype=torch.float32)
    if x.numel():
        s0, s1 = x.stride(0), x.stride(1)
        flat = x.detach().as_strided(((t - 1) * s0 + (nh - 1) * s1 + d,), (1,)).numpy()
        _norm_rope_kernel(flat, s0, s1, weight.detach().numpy(), np.float32(eps), cos.detach().numpy(),
                          sin.detach().numpy(), out.numpy())
    return out


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
def _norm_rope_kernel(x, s0, s1, w, eps, cos, sin, out):  # pragma: no cover - compiled
    """x: row (i, h) of [T, H, D] at i * s0 + h * s1 (flat); out [T, H, D]; w [D]; cos, sin [T, R]."""
    t, nh, d = out.shape
    half = cos.shape[1] // 2
    scale = np.empty(d, dtype=np.float32)
    for j in range(d):
        scale[j] = np.float32(1.0) + w[j]
    n = np.empty(d, dtype=np.float32)
    for i in range(t):
        c, s = cos[i], sin[i]
        for h in range(nh):
            row = x[i * s0 + h * s1: i * s0 + h * s1 + d]
            ss = np.float32(0.0)
            for j in range(d):
                ss += row[j] * row[j]
            r = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
            for j in range(d):
                n[j] = (row[j] * r) * scale[j]
            dst = out[i, h]
            for j in range(half):
                dst[j] = n[j] * c[j] + (-n[j + half]) * s[j]
                dst[j + half] = n[j + half] * c[j + half] + n[j] * s[j + half]
            for j in range(2 * half, d):
                dst[j] = n[j]
