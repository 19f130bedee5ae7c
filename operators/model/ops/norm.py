"""The norms in torch ops, for every device and dtype: the twins of `norm_cpu`'s compiled passes
(`layers.RMSNorm` / `GatedRMSNorm` pick one), below `layers` so the compiled ops can use them too."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` in torch ops (every device and dtype): x [..., D], weight [D] -> [..., D]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`GatedRMSNorm` in torch ops (every device and dtype): x, z [..., D], weight [D] -> [..., D]."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * h * F.silu(z.float())).to(x.dtype)
