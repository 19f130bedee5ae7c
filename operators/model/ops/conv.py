"""Causal depthwise conv1d of Gated DeltaNet, with its state.

State convention (same as transformers): `conv_state [B, C, K]` holds the last K inputs
of the sequence so far (zeros before the sequence start), K = kernel size. Output at
step t is `act(sum_j w[c, j] * x[t - K + 1 + j, c])`: only the last K - 1 stored inputs
plus the new one are read; the oldest stored entry exists to keep the transformers layout.

- `causal_conv1d_prefill`: L new inputs from a given state (one conv call).
- `causal_conv1d_step`: one new input per sequence, batched over B (decode);
  `causal_conv1d_step_slots`: the same on states kept in a pool, by slot, in place.
- `causal_conv1d_packed`: sequences of different lengths packed in `[T, C]` (the engine's
  ragged prefill), each from its own state.
- `causal_conv1d_naive`: per-step loop, the reference for both.
Step and packed forms run as compiled loops on CPU float32 (`conv_cpu.py`); their torch
forms (`*_torch`) serve every other device and dtype and are the compiled loops' twins.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlbatch.operators.model.ops import conv_cpu


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


def causal_conv1d_step_slots(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                             slots: torch.Tensor) -> torch.Tensor:
    """`causal_conv1d_step` for the states pool[slots] (pool [S, C, K], slots [B] distinct),
    updated in place in the pool -> silu(conv) [B, C]. CPU float32: the compiled loop indexes
    the pool; otherwise gather, step, store back."""
    if conv_cpu.usable(x, weight, pool) and pool.is_contiguous():
        return conv_cpu.conv1d_step_slots_cpu(x, weight, pool, slots)
    out, new_state = causal_conv1d_step_torch(x, weight, pool.index_select(0, slots))
    pool.index_copy_(0, slots, new_state.to(pool.dtype))
    return out


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, C] (one new input each), weight: [C, K], conv_state: [B, C, K].

    Returns (silu(conv) [B, C], new conv_state [B, C, K]). CPU float32: the compiled
    loop (`conv_cpu`); otherwise `causal_conv1d_step_torch`. `inplace`: the caller gives
    `conv_state` up (a decode step's pool view, like the recurrent state): the new state may be
    written over it and returned, so storing it back copies nothing.
    """
    if conv_cpu.usable(x, weight, conv_state):
        return conv_cpu.conv1d_step_cpu(x, weight, conv_state, inplace)
    return causal_conv1d_step_torch(x, weight, conv_state)


def causal_conv1d_step_torch(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_step` in torch ops (every device and dtype)."""
    new_state = torch.cat([conv_state[:, :, 1:].to(x.dtype), x.unsqueeze(-1)], dim=-1)
    out = torch.einsum("bck,ck->bc", new_state, weight.to(x.dtype))  # a batched matmul: ~3x a size-K sum
    return F.silu(out, inplace=True), new_state


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


def causal_conv1d_packed(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, lens: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of `lens` tokens packed in x [T, C] (channels last), each from its state.

    weight [C, K], conv_state [B, C, K]. Returns (silu(conv) [T, C], new conv_state [B, C, K]).
    CPU float32: the compiled loop (`conv_cpu`); otherwise `causal_conv1d_packed_torch`.
    """
    if conv_cpu.usable(x, weight, conv_state):
        return conv_cpu.conv1d_packed_cpu(x, weight, conv_state, lens)
    return causal_conv1d_packed_torch(x, weight, conv_state, lens)


def causal_conv1d_packed_torch(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, lens: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_packed` in torch ops (every device and dtype). Each sequence's K stored inputs and
    then its own rows are laid out in one buffer [B * K + T, C]; the conv is K shifted multiply-adds over
    it (no transposes), and a row's window never reaches into another sequence's segment.
    """
    t, c = x.shape
    b, _, k = conv_state.shape
    dev = x.device
    lengths = torch.tensor(lens, dtype=torch.long)
    seg_end = (lengths + k).cumsum(0)  # [B] end of each segment in the buffer
    seg_start = seg_end - lengths - k
    # [T] buffer row of each token
    x_rows = torch.arange(t) + k * (torch.repeat_interleave(torch.arange(b), lengths) + 1)
    s_rows = (seg_start[:, None] + torch.arange(k)).view(-1)  # [B * K]
    buf = x.new_empty(b * k + t, c)
    buf.index_copy_(0, x_rows.to(dev), x)
    buf.index_copy_(0, s_rows.to(dev), conv_state.to(x.dtype).transpose(1, 2).reshape(b * k, c))
    w = weight.to(x.dtype).t()  # [K, C]
    rows = buf.shape[0] - k + 1  # output r reads buffer rows r .. r + K - 1
    out = buf[0:rows] * w[0]
    for j in range(1, k):
        out.addcmul_(buf[j: rows + j], w[j])
    out = F.silu(out.index_select(0, (x_rows - (k - 1)).to(dev)), inplace=True)
    last = (seg_end[:, None] - k + torch.arange(k)).view(-1)  # [B * K] the last K rows of each segment
    new_state = buf.index_select(0, last.to(dev)).view(b, k, c).transpose(1, 2).contiguous()
    return out, new_state
