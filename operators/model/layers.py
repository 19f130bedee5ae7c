"""Small shared layers of the decoder: norms, activations, the SwiGLU FFN.

- `RMSNorm`: zero-centred RMSNorm, `x / rms(x) * (1 + w)`, computed in float32 and
  cast back (decoder norms and the full-attention q/k norms).
- `GatedRMSNorm`: DeltaNet output norm, `(x / rms(x)) * w * silu(z)` (scale `w` itself,
  initialised to 1, not zero-centred).
  Both: on CPU float32 one compiled pass per row (`ops/norm_cpu.py`); elsewhere the torch
  forms `rms_norm_torch` / `gated_rms_norm_torch` (the twins, in `ops/norm.py`).
- `SwiGLU`: `down(act(gate(x)) * up(x))`, the dense FFN and the MoE shared expert.
- `embedding`: an `nn.Embedding` built without its random initialisation.
- `fuse_linears`: the load-time transform that lets several projections of one input run
  as one matmul (the weights concatenated; the original parameters become views of it);
  it also points the module's `_project` at its fused form, so no forward checks
  `fused_weight` per call (`unfuse_linears` undoes both).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model.ops import norm_cpu
from vlbatch.operators.model.ops.norm import gated_rms_norm_torch, rms_norm_torch

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


def embedding(num: int, dim: int) -> nn.Embedding:
    """`nn.Embedding(num, dim)` without its random init: the loader replaces the weight anyway,
    and `normal_` on the meta device goes through a Python reference that imports
    torch._dynamo (about 3 CPU-s of every model load)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last dim: [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_cpu.usable(x, self.weight):
            return norm_cpu.rms_norm_cpu(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm then SiLU gate: x, z [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if norm_cpu.usable(x, z, self.weight):
            return norm_cpu.gated_rms_norm_cpu(x, z, self.weight, self.eps)
        return gated_rms_norm_torch(x, z, self.weight, self.eps)


def fuse_linears(module: nn.Module, linears: list[nn.Linear]) -> None:
    """Concatenate the weights (and biases) of `linears`, which all read the same input, into
    `module.fused_weight` [sum N_i, D] (+ `fused_bias`); each linear's parameters become
    views of it, so parameter names, values and memory stay those of the checkpoint.

    Call after the weights are loaded and on their final device and dtype (`.to()` later
    copies the views and the fused tensor separately). `module` must have registered
    `fused_weight` / `fused_bias` as (None) buffers."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row: row + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row: row + n], requires_grad=False)
        row += n
    module.fused_weight, module.fused_bias = weight, bias
    module._project = module._project_fused  # decided here, once: no `fused_weight is None` per call


def unfuse_linears(module: nn.Module) -> None:
    """Undo `fuse_linears` on `module`: separate projections again (the reference path, for tests)."""
    module.fused_weight = module.fused_bias = None
    module.__dict__.pop("_project", None)


def fused_buffers(module: nn.Module) -> None:
    """Register the (empty) `fused_weight` / `fused_bias` buffers `fuse_linears` fills."""
    module.register_buffer("fused_weight", None, persistent=False)
    module.register_buffer("fused_bias", None, persistent=False)


class SwiGLU(nn.Module):
    """Gated FFN: [T, D] -> [T, D] through width `inner`. After `fuse_()`, gate and up run
    as one [T, D] x [D, 2 * inner] matmul."""

    def __init__(self, dim: int, inner: int, act: str):
        super().__init__()
        self.inner = inner
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.act = activation(act)
        fused_buffers(self)

    def fuse_(self) -> None:
        fuse_linears(self, [self.gate_proj, self.up_proj])

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> gate, up [T, inner] (separate projections; `fuse_` swaps in `_project_fused`)."""
        return self.gate_proj(x), self.up_proj(x)

    def _project_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.linear(x, self.fused_weight)  # [T, 2 * inner]: gate | up
        return h[:, : self.inner], h[:, self.inner:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._project(x)
        return self.down_proj(self.act(gate).mul_(up))  # act(gate) is a new tensor: multiply in place
