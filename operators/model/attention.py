"""Full-attention mixer: gated q projection, q/k RMSNorm, partial MRoPE, GQA, sigmoid output gate.

Per token (seed 000 section 10): `q_proj(x)` is viewed [H_q, 2 * D] per head and split
into query [H_q, D] and gate [H_q, D] (per-head halves, not the two halves of the flat
vector). q and k get a zero-centred RMSNorm over D, then MRoPE on their first
`rotary_dim` dims. Attention itself (causal, GQA, over cached + new tokens) is done by
the step cache (`StepCache.attention`), so storage stays outside the model. The output
is multiplied by `sigmoid(gate)` before `o_proj`.
"""
from __future__ import annotations

import torch
from torch import nn

from operators.model.cache import StepCache
from operators.model.config import TextConfig
from operators.model.layers import RMSNorm
from operators.model.rope import apply_partial_rope


class FullAttention(nn.Module):
    """[T, D_model] packed tokens -> [T, D_model]."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.n_q, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_q * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_q * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StepCache, attn_idx: int
    ) -> torch.Tensor:
        """x [T, D_model]; cos / sin [T, rotary_dim]."""
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.n_q, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)  # [T, H_q, D]
        k = apply_partial_rope(self.k_norm(self.k_proj(x).view(t, self.n_kv, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
        out = cache.attention(attn_idx, q, k, v).to(x.dtype)  # [T, H_q, D]
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)
