"""The reference: a Python loop over the experts, each running its tokens as one matmul."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vlbatch.operators.kernels.moe.base import ExpertsKernel


@dataclass(frozen=True)
class LoopExperts(ExpertsKernel):
    """Slots sorted by expert (stable), then per expert with tokens: gather, SwiGLU, and a
    weighted `index_add_` into the output (one host sync for the counts)."""

    name: ClassVar[str] = "loop"

    def __call__(self, x, index, weight, gate_up, down, act):
        k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start: start + count]
            start += count
            tokens = slots // k
            gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(act(gate) * up, down[expert])
            out.index_add_(0, tokens, y * weight.reshape(-1)[slots, None])
        return out
