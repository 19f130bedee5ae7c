"""Experts as two grouped matmuls (`torch._grouped_mm`): the T * k slots sorted by expert
are one [T * k, D] matrix cut into per-expert row groups by `offs`; no Python loop over
experts and no host sync. `torch._grouped_mm` needs 16-byte aligned strides (D and I
times the element size) and, on CUDA, bfloat16 on compute capability 9.0 or newer;
`GroupedMMExperts.create` checks that once at load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels.moe.base import ExpertsKernel, sort_by_expert


@dataclass(frozen=True)
class GroupedMMExperts(ExpertsKernel):
    name: ClassVar[str] = "grouped_mm"

    @classmethod
    def create(cls, device, dtype: torch.dtype, dim: int, inner: int) -> GroupedMMExperts:
        if not grouped_mm_supported(torch.device(device), dtype, dim, inner):
            raise ConfigError(f"model.engine.moe='grouped_mm': torch._grouped_mm does not take {dtype} experts of "
                              f"dims {dim} / {inner} on {device}")
        return cls()

    def __call__(self, x, index, weight, gate_up, down, act):
        order, tokens, counts = sort_by_expert(index, gate_up.shape[0])
        offs = counts.cumsum(0).to(torch.int32)  # [E] group ends
        gate, up = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [T * k, I]
        y = torch._grouped_mm((act(gate) * up).contiguous(), down.transpose(1, 2), offs=offs)  # [T * k, D]
        return torch.zeros_like(x).index_add_(0, tokens, y * weight.reshape(-1)[order, None])


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, dim: int, inner: int) -> bool:
    """Whether `torch._grouped_mm` takes these experts' matrices (see the module docstring)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    if not hasattr(torch, "_grouped_mm") or (dim * elem) % 16 or (inner * elem) % 16:
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
