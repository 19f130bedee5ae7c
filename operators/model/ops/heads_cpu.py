"""DeltaNet q / k heads on the CPU as one compiled pass (numba): L2 norm, head expansion, q scale.

Same contract as `qk_heads_torch` (the twin; every other device and dtype takes it):
qk [T, 2 * H_k * D_k] (q heads then k heads, rows of any stride) ->
q, k [T, H_v, D_k] float32, each key head i serving value heads i*r .. i*r + r - 1 (r = H_v / H_k):

    n = x / sqrt(sum_j x[j]^2 + eps);   q = n_q * scale,  k = n_k   (copied r times)

The torch form makes ~6 passes over [T, 2, H_k, D_k] (square, sum, rsqrt, scale, the expanding
copy, q's scale), each a fresh tensor; here each head row is read twice and each output row
written once. The sum of squares is vectorised (reassociated), so results differ from torch's
in the last bits (tested within 1e-6, tests/test_model_heads_cpu.py).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from vlbatch.operators.model.ops.cpu import cpu_float32


def qk_heads_torch(qk: torch.Tensor, n_k: int, n_v: int, d_k: int, scale: float,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: qk [T, 2 * H_k * D_k] -> q, k [T, H_v, D_k] float32 (q L2-normalised and scaled)."""
    t = qk.shape[0]
    x = qk.reshape(t, 2, n_k, d_k).float()  # q and k in one pass
    x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    if n_v != n_k:  # = repeat_interleave on dim 2, as one strided copy (~3x faster on CPU)
        r = n_v // n_k
        x = x.unsqueeze(3).expand(t, 2, n_k, r, d_k).reshape(t, 2, n_v, d_k)
    q, k = x.unbind(1)
    return q * scale, k


def usable(qk: torch.Tensor) -> bool:
    """CPU float32 (rows of any stride, unit stride inside a row: the kernel reads a numpy view)."""
    return cpu_float32(qk) and qk.stride(-1) == 1


def warm_up() -> None:
    """Load (or compile and cache) the kernel at model load (its input is always one flat
    contiguous array, so one compiled form serves every row stride)."""
    qk_heads_cpu(torch.zeros(2, 8)[:, :4], 1, 1, 2, 1.0)


def qk_heads_cpu(qk: torch.Tensor, n_k: int, n_v: int, d_k: int, scale: float,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """As `qk_heads_torch`, one compiled pass; q, k contiguous. The rows of `qk` (unit stride
    inside a row, any row stride: a view of the conv output) reach the kernel as one flat array
    and a row stride, so its loops along D_k have unit stride and vectorise (a strided 2-D
    view compiles to per-element stride arithmetic: ~2x slower than the torch twin)."""
    t, width = qk.shape
    q = torch.empty(t, n_v, d_k, dtype=torch.float32)
    k = torch.empty(t, n_v, d_k, dtype=torch.float32)
    if t:
        flat = qk.detach().as_strided(((t - 1) * qk.stride(0) + width,), (1,)).numpy()
        _heads_kernel(flat, qk.stride(0), n_k, n_v // n_k, d_k, np.float32(scale), np.float32(eps),
                      q.numpy(), k.numpy())
    return q, k


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
def _heads_kernel(flat, rs, n_k, r, d, scale, eps, q, k):  # pragma: no cover - compiled
    """flat: row i of qk [T, 2 * n_k * d] at i * rs; q, k [T, n_k * r, d] (C-contiguous)."""
    for i in range(q.shape[0]):
        for h in range(n_k):
            base = i * rs + h * d
            _head(flat[base: base + d], scale, eps, q[i], h * r, r)
            base = i * rs + (n_k + h) * d
            _head(flat[base: base + d], np.float32(1.0), eps, k[i], h * r, r)


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"}, inline="always")
def _head(src, mult, eps, out, h0, r):  # pragma: no cover - compiled
    """src [d] one head row -> out[h0 .. h0 + r - 1] [r, d] = src / |src| * mult. Through 1-D
    slices, so both loops run at unit stride in vector registers: written with 3-D indices into
    q or k (chosen per part) the same loops ran ~4x slower than this."""
    d = src.shape[0]
    ss = np.float32(0.0)
    for j in range(d):
        ss += src[j] * src[j]
    f = np.float32(1.0) / np.sqrt(ss + eps)
    for c in range(r):
        dst = out[h0 + c]
        for j in range(d):
            dst[j] = (src[j] * f) * mult  # the twin's rounding: normalise, then scale
