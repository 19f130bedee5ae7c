"""Causal depthwise conv1d of Gated DeltaNet, with its state.

State convention (same as transformers): `conv_state [B, C, K]` holds the last K inputs
of the sequence so far (zeros before the sequence start), K = kernel size. Output at
step t is `act(sum_j w[c, j] * x[t - K + 1 + j, c])`: only the last K - 1 stored inputs
plus the new one are read; the oldest stored entry exists to keep the transformers layout.

- `causal_conv1d_prefill`: L new inputs from a given state (one conv call).
- `causal_conv1d_step`: one new input per sequence, batched over B (decode).
- `causal_conv1d_naive`: per-step loop, the reference for both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, C, L], weight: [C, K], conv_state: [B, C, K] or None (zeros).

    Returns (silu(conv) [B, C, L], new conv_state [B, C, K]). `lengths` [B] (long) marks
    right-padded input: sequence b has only its first `lengths[b]` inputs real, its new
    state holds the last K inputs up to there (outputs past it are padding garbage).
    """
    b, c, length = x.shape
    k = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(b, c, k)
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, K + L]
    out = F.conv1d(full, weight.unsqueeze(1).to(x.dtype), groups=c)  # [B, C, L + 1]
    if lengths is None:
        new_state = full[:, :, -k:].contiguous()
    else:  # inputs lengths[b] .. lengths[b] + K - 1 of `full` are the last K real ones
        idx = lengths.to(x.device)[:, None] + torch.arange(k, device=x.device)  # [B, K]
        new_state = full.gather(2, idx[:, None, :].expand(b, c, k))
    return F.silu(out[:, :, 1:]), new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, C] (one new input each), weight: [C, K], conv_state: [B, C, K].

    Returns (silu(conv) [B, C], new conv_state [B, C, K]).
    """
    new_state = torch.cat([conv_state[:, :, 1:].to(x.dtype), x.unsqueeze(-1)], dim=-1)
    out = (new_state * weight.to(x.dtype)).sum(-1)
    return F.silu(out), new_state


def causal_conv1d_naive(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the definition, one position at a time. Same shapes as the prefill form."""
    b, c, length = x.shape
    k = weight.shape[-1]
    window = x.new_zeros(b, c, k) if conv_state is None else conv_state.clone().to(x.dtype)
    outs = []
    for t in range(length):
        window = torch.cat([window[:, :, 1:], x[:, :, t : t + 1]], dim=-1)
        outs.append(F.silu((window * weight).sum(-1)))
    return torch.stack(outs, dim=-1), window
