"""RMSNorm and the DeltaNet gated RMSNorm on the CPU as one compiled pass per row (numba).

Same contracts as `norm.rms_norm_torch` / `norm.gated_rms_norm_torch`, the torch forms
beside them (the twins; every other device and dtype takes them). The torch forms make
~5 passes over [T, D] (square, mean, scale, weight, cast), each a fresh tensor; here a
row (2 KiB at D = 512: L1) is read twice and written once:

    r = 1 / sqrt(sum_j x[j]^2 / D + eps);   out[j] = x[j] * r * (1 + w[j])   (zero-centred)
    gated: out[j] = ((x[j] * r) * w[j]) * silu(z[j])   (the SiLU by torch: vectorised; the kernel
           multiplies it in and writes over it, so the gated form allocates one tensor, not two)

The sum of squares is vectorised (reassociated), so results differ from torch's in the
last bits (tested within 1e-6, tests/test_model_norm_cpu.py). `usable(...)` says when
they apply (CPU float32).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from vlbatch.operators.model.ops.cpu import cpu_float32

usable = cpu_float32  # CPU float32 tensors, any strides (the kernels read numpy views)


def warm_up() -> None:
    """Load (or compile and cache) the kernel at model load (its rows are always contiguous)."""
    rms_norm_cpu(torch.zeros(2, 4), torch.zeros(4), 1e-6)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = True) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] float32: x / rms(x) * (1 + w) (`zero_centred`) or * w."""
    out = torch.empty(x.shape, dtype=torch.float32)
    return _run(x, weight, eps, zero_centred, out, gated=False)


def gated_rms_norm_cpu(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [..., D], weight [D] -> [..., D] float32: (x / rms(x)) * w * silu(z)."""
    return _run(x, weight, eps, False, F.silu(z).contiguous(), gated=True)  # a fresh tensor: overwritten


def _run(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool, out: torch.Tensor,
         gated: bool) -> torch.Tensor:
    """The kernel over x's rows into `out` (contiguous float32, x's shape; read first as the gate
    when `gated`) -> out."""
    d = x.shape[-1]
    rows = out.view(-1, d).numpy()
    _rms_kernel(x.detach().reshape(-1, d).numpy(), weight.detach().numpy(), np.float32(eps), zero_centred,
                gated, rows)
    return out


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
def _rms_kernel(x, w, eps, zero_centred, gated, out):  # x [N, D] (row stride free), w [D], out [N, D]
    """out = x / rms(x) * scale, times out's own values first when `gated` (out holds the gate)."""
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
        dst = out[i]
        if gated:
            for j in range(d):
                dst[j] = ((row[j] * r) * scale[j]) * dst[j]
        else:
            for j in range(d):
                dst[j] = (row[j] * r) * scale[j]
