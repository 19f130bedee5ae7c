"""`auto`, the default MoE choice: the grouped matmul where torch takes the experts, else padded."""
from __future__ import annotations

import torch

from vlbatch.operators.kernels.moe import select_experts
from vlbatch.operators.kernels.moe.base import ExpertsKernel
from vlbatch.operators.kernels.moe.grouped import grouped_mm_supported


def auto(device, dtype: torch.dtype, dim: int, inner: int) -> ExpertsKernel:
    """`grouped_mm` where `torch._grouped_mm` takes these shapes and dtype on `device`, else `padded`."""
    fits = grouped_mm_supported(torch.device(device), dtype, dim, inner)
    return select_experts(device, dtype, dim, inner, "grouped_mm" if fits else "padded")
