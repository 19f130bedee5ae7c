"""Small shared layers of the decoder: norms, activations, the SwiGLU FFN.

- `RMSNorm`: zero-centred RMSNorm, `x / rms(x) * (1 + w)`, computed in float32 and
  cast back (decoder norms and the full-attention q/k norms).
- `GatedRMSNorm`: DeltaNet output norm, `(x / rms(x)) * w * silu(z)` (scale `w` itself,
  initialised to 1, not zero-centred).
- `SwiGLU`: `down(act(gate(x)) * up(x))`, the dense FFN and the MoE shared expert.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from operators.errors import ConfigError

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function named in config.json (hidden_act)."""
    if name not in _ACTIVATIONS:
        raise ConfigError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last dim: [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm then SiLU gate: x, z [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * h * F.silu(z.float())).to(x.dtype)


class SwiGLU(nn.Module):
    """Gated FFN: [T, D] -> [T, D] through width `inner`."""

    def __init__(self, dim: int, inner: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
