"""The MoE routed experts behind one contract (`base.ExpertsKernel`).

Implementations: `grouped.GroupedMMExperts` (two `torch._grouped_mm` calls), `padded.PaddedExperts`
(two padded `torch.bmm` calls, any device and dtype) and `naive.LoopExperts` (a Python loop
over the experts: the reference).

`select_experts(device, dtype, dim, inner, choice)` is called once by `load_model` for MoE
checkpoints: "auto" (the default) takes the grouped matmul where `torch._grouped_mm` takes
these shapes and dtype on this device (`grouped.grouped_mm_supported`), else the padded one;
"grouped_mm", "padded" and "loop" force one.
"""
from __future__ import annotations

import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels.moe.base import ExpertsKernel
from vlbatch.operators.kernels.moe.grouped import GroupedMMExperts, grouped_mm_supported
from vlbatch.operators.kernels.moe.naive import LoopExperts
from vlbatch.operators.kernels.moe.padded import PaddedExperts

CHOICES = ("auto", "grouped_mm", "padded", "loop")

__all__ = ["CHOICES", "ExpertsKernel", "GroupedMMExperts", "LoopExperts", "PaddedExperts", "select_experts"]


def select_experts(device: str | torch.device, dtype: torch.dtype, dim: int, inner: int,
                   choice: str = "auto") -> ExpertsKernel:
    """The experts kernel for [E, 2 * inner, dim] / [E, dim, inner] weights of `dtype` on `device`."""
    if choice not in CHOICES:
        raise ConfigError(f"experts kernel {choice!r}; allowed: {', '.join(CHOICES)}")
    fits = grouped_mm_supported(torch.device(device), dtype, dim, inner)
    if choice == "grouped_mm" and not fits:
        raise ConfigError(f"torch._grouped_mm does not take {dtype} experts of dims {dim} / {inner} on {device}")
    if choice == "grouped_mm" or (choice == "auto" and fits):
        return GroupedMMExperts()
    return LoopExperts() if choice == "loop" else PaddedExperts()
