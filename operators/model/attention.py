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
import torch.nn.functional as F
from torch import nn

from vlbatch.operators.model.cache import StepCache
from vlbatch.operators.model.config import TextConfig
from vlbatch.operators.model.layers import RMSNorm, fuse_linears, fused_buffers
from vlbatch.operators.model.ops import rope_cpu


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
        self._sizes = [self.n_q * self.head_dim * 2, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        fused_buffers(self)

    def fuse_(self) -> None:
        """q / k / v projections as one matmul (a load-time transform)."""
        fuse_linears(self, [self.q_proj, self.k_proj, self.v_proj])

    def _project(self, x: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> q [T or n, 2 * H_q * D], k / v [T, H_kv * D] (q for rows `keep` only;
        separate projections: `fuse_` swaps in `_project_fused` once, at load)."""
        return self.q_proj(x if keep is None else x[keep]), self.k_proj(x), self.v_proj(x)

    def _project_fused(self, x: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """As `_project`, through the fused [q | k | v] weight."""
        if keep is None:
            return F.linear(x, self.fused_weight, self.fused_bias).split(self._sizes, dim=-1)
        xq = x[keep]
        nq, w, b = self._sizes[0], self.fused_weight, self.fused_bias
        q = F.linear(xq, w[:nq], None if b is None else b[:nq])
        k, v = F.linear(x, w[nq:], None if b is None else b[nq:]).split(self._sizes[1:], dim=-1)
        return q, k, v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StepCache, attn_idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, D_model]; cos / sin [T, rotary_dim] -> [T, D_model], or [n, D_model] for rows
        `keep` [n] (K/V of every row are still stored)."""
        t = x.shape[0]
        q, k, v = self._project(x, keep)
        n = q.shape[0]
        q, gate = q.view(n, self.n_q, 2 * self.head_dim).chunk(2, dim=-1)
        qcos, qsin = (cos, sin) if keep is None else (cos[keep], sin[keep])
        q = _norm_rope(q, self.q_norm, qcos, qsin)  # [n, H_q, D]
        k = _norm_rope(k.view(t, self.n_kv, self.head_dim), self.k_norm, cos, sin)
        v = v.view(t, self.n_kv, self.head_dim)
        out = (cache.attention(attn_idx, q, k, v) if keep is None
               else cache.attention(attn_idx, q, k, v, keep)).to(x.dtype)  # [n, H_q, D]
        out = out.reshape(n, self.n_q * self.head_dim) * torch.sigmoid(gate.reshape(n, self.n_q * self.head_dim))
        return self.o_proj(out)


def _norm_rope(x: torch.Tensor, norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> RMSNorm then partial MRoPE [T, H, D]: one compiled pass on CPU float32
    (`ops/rope_cpu.py`), else the torch twin."""
    if rope_cpu.usable(x, norm.weight, cos, sin):
        return rope_cpu.norm_rope_cpu(x, norm.weight, norm.eps, cos, sin)
    return rope_cpu.norm_rope_torch(x, norm.weight, norm.eps, cos, sin)
