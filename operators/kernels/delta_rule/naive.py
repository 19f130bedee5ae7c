"""The naive gated delta rule: the seed's per-token loop, and the contract over it.

`delta_rule_naive` is the seed's teaching loop (section 9.10) in its own layout
`[B, H, L, *]` with the retention factor alpha = exp(g). `NaiveDeltaRule` runs the
`DeltaRuleKernels` contract (`base.py`) through it one sequence at a time, in float64:
the reference the fast implementations are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels


@dataclass(frozen=True)
class NaiveDeltaRule(DeltaRuleKernels):
    """The contract by the per-token loop, per sequence, float64 inside (slow: tests only)."""

    name: ClassVar[str] = "naive"

    def prefill(self, q, k, v, g, beta, state, lens):
        outs, states, row = [], [], 0
        for b, n in enumerate(lens):
            o, s = _rows(*(x[row: row + n] for x in (q, k, v, g, beta)), state[b])
            outs.append(o)
            states.append(s)
            row += n
        return torch.cat(outs).to(v.dtype), torch.stack(states).float()

    def decode_(self, q, k, v, g, beta, state):
        rows = [_rows(q[b, None], k[b, None], v[b, None], g[b, None], beta[b, None], state[b])
                for b in range(q.shape[0])]
        state.copy_(torch.stack([s for _, s in rows]))
        return torch.cat([o for o, _ in rows]).to(v.dtype)


def _rows(q, k, v, g, beta, state):
    """One sequence [L, H, *] from state [H, K, V] -> (o [L, H, V], state [H, K, V]) float64."""
    o, s = delta_rule_naive(*(x.double().transpose(0, 1)[None] for x in (q, k, v)), g.double().exp().t()[None],
                            beta.double().t()[None], state.double()[None])
    return o[0].transpose(0, 1), s[0]


def delta_rule_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference loop (seed 000 section 9.10): q, k [B, H, L, K], v [B, H, L, V],
    alpha (retention = exp(g)), beta [B, H, L], state [B, H, K, V]. Returns (o [B, H, L, V], state).
    """
    if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if alpha.shape != k.shape[:3] or beta.shape != k.shape[:3]:
        raise ValueError("alpha and beta must be [B, H, L]")
    b, h, length, dk = k.shape
    s = k.new_zeros(b, h, dk, v.shape[-1]) if state is None else state.clone()
    outputs = []
    for t in range(length):
        s = alpha[:, :, t, None, None] * s
        read = torch.einsum("bhk,bhkv->bhv", k[:, :, t], s)
        correction = beta[:, :, t, None] * (v[:, :, t] - read)
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, :, t], correction)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], s))
    return torch.stack(outputs, dim=2), s
