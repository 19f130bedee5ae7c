"""RMSNorm and the DeltaNet gated RMSNorm on the CPU as one compiled pass per row (numba).

Same contracts as `layers.rms_norm_torch` / `layers.gated_rms_norm_torch`, the torch forms
beside them (the twins; every other device and dtype takes them). The torch forms make
~5 passes over [T, D] (square, mean, scale, weight, cast), each a fresh tensor; here a
row (2 KiB at D = 512: L1) is read twice and written once:

    r = 1 / sqrt(sum_j x[j]^2 / D + eps);   out[j] = x[j] * r * (1 + w[j])   (zero-centred)
    gated: out[j] = w[j] * (x[j] * r) * silu(z[j])   (the SiLU by torch, in place: vectorised)

The sum of squares is vectorised (reassociated), so results differ from torch's in the
last bits (tested within 1e-6, tests/test_model_norm_cpu.py). `usable(...)` says when
they apply (CPU float32).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from vlbatch.operators.model.ops import cpu_float32

usable = cpu_float32  # CPU float32 tensors, any strides (the kernels read numpy views)


def warm_up() -> None:
    """Load (or compile and cache) the kernel at model load (its rows are always contiguous)."""
    rms_norm_cpu(torch.zeros(2, 4), torch.zeros(4), 1e-6)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = True) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] float32: x / rms(x) * (1 + w) (`zero_centred`) or * w."""
    d = x.shape[-1]
    rows = x.detach().reshape(-1, d)
    out = torch.empty(rows.shape, dtype=torch.float32)
    _rms_kernel(rows.numpy(), weight.detach().numpy(), np.float32(eps), zero_centred, out.numpy())
    return out.view(x.shape)


def gated_rms_norm_cpu(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [..., D], weight [D] -> [..., D] float32: (x / rms(x)) * w * silu(z)."""
    return rms_norm_cpu(x, weight, eps, zero_centred=False).mul_(F.silu(z))


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
def _rms_kernel(x, w, eps, zero_centred, out):  # x [N, D] (row stride free), w [D], out [N, D]
    n, d = x.shape
    scale = np.empty(d, dtype=np.float32)
    for j in range(d):
        scale[j] = np.float32(1.0) + w[j] if zero_centred else w[j]
    for i in range(n):
        row = x[i]
        ss = np.float32(0.0)
        for j in range(d):
            ss += row[j] * row[j]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for j in range(d):
            out[i, j] = (row[j] * r) * scale[j]
