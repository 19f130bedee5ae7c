"""Experts as two padded batched matmuls (`torch.bmm`), for where `torch._grouped_mm` does
not apply: the slots sorted by expert are scattered into [A, C, D] (A experts that have
tokens, C the largest count, zero rows as padding), one bmm per projection over the A
experts' weights (copied out when A < E), and the real rows gathered back. One host
sync (A and C)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlbatch.operators.kernels.moe.base import ExpertsKernel, sort_by_expert


@dataclass(frozen=True)
class PaddedExperts(ExpertsKernel):
    name: ClassVar[str] = "padded"

    def __call__(self, x, index, weight, gate_up, down, act):
        order, tokens, counts = sort_by_expert(index, gate_up.shape[0])
        flat = index.reshape(-1)
        expert = flat[order]
        present = counts > 0
        active = present.nonzero().squeeze(1)  # [A] experts with tokens
        group = present.cumsum(0)[expert] - 1  # [T * k] batch row of each slot's expert
        rank = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[expert]  # row in its group
        buf = x.new_zeros(active.numel(), int(counts.max()), x.shape[1])  # [A, C, D]
        buf[group, rank] = x[tokens]
        if active.numel() < gate_up.shape[0]:  # copy the weights of the experts in use only
            gate_up, down = gate_up[active], down[active]
        gate, up = torch.bmm(buf, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [A, C, I]
        y = torch.bmm(act(gate) * up, down.transpose(1, 2))  # [A, C, D]
        return torch.zeros_like(x).index_add_(0, tokens, y[group, rank] * weight.reshape(-1)[order, None])
