"""Sparse MoE FFN (Qwen3.5 MoE): softmax router, top-k renormalised, routed experts plus a
gated shared expert.

    p = softmax(x W_router^T) in float32; (w, e) = top_k(p); w = w / sum(w)
    y = sum_j w_j * SwiGLU_{e_j}(x) + sigmoid(x W_sg^T) * SwiGLU_shared(x)

Expert weights are stacked as transformers holds them: `experts.gate_up_proj
[E, 2 * I, D]` (gate rows first, then up) and `experts.down_proj [E, D, I]`; the
loader fills them from either that fused form or the per-expert tensors
(`experts.{e}.gate_proj.weight`, ...) that `save_pretrained` and the released
checkpoints write.
"""
from __future__ import annotations

import torch
from torch import nn

from vlbatch.operators.kernels.moe.base import ExpertsKernel
from vlbatch.operators.kernels.moe.padded import PaddedExperts
from vlbatch.operators.model.config import TextConfig
from vlbatch.operators.model.layers import SwiGLU, activation


class Experts(nn.Module):
    """E SwiGLU experts in stacked tensors, computed by `self.kernel` (`operators/kernels/moe`:
    grouped matmuls by default; `load_model` picks it once through `Qwen35Model.use_experts`)."""

    def __init__(self, num_experts: int, dim: int, inner: int, act: str):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, inner))
        self.act = activation(act)
        self.kernel: ExpertsKernel = PaddedExperts()

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [T, D], index / weight: [T, k] -> [T, D] (weighted sum over the k chosen experts)."""
        return self.kernel(x, index, weight, self.gate_up_proj, self.down_proj, self.act)


class SparseMoE(nn.Module):
    """Router + experts + shared expert: [T, D] -> [T, D]."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (index [T, k] int64, weight [T, k] x.dtype): softmax over the experts in
        float32, the top k, renormalised to sum to 1 (the one routing rule; `ParallelMoE` too)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        return top_i, (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)

    def routed(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, D] (a parallel rank overrides which it runs)."""
        return self.experts(x, index, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed(x, *self.route(x))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
