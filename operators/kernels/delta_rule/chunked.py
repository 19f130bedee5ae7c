"""The gated delta rule in torch, per sequence: chunked prefill, batched recurrent decode.

Recurrence per head (seed 000 sections 9.6 and 9.11; `base.py`), with S [K, V]:

    S_t = exp(g_t) * S_{t-1}                   decay
    d_t = beta_t * (v_t - S_t^T k_t)           correction along the key
    S_t = S_t + k_t d_t^T                      write
    o_t = S_t^T q_t                            read

Inputs of `chunk_gated_delta_rule` and `recurrent_gated_delta_rule` are already
prepared by the layer: q / k L2-normalised, expanded to the value heads, and q scaled
by 1/sqrt(K). Layout `[B, T, H, *]`; states `[B, H, K, V]`. All arithmetic is float32;
outputs are returned in the dtype of `v`, states in float32.

`recurrent_gated_delta_rule_` is the torch kernels' decode (`torch_rule.py`); the packed
prefill is `packed.py`. The naive reference loop is `naive.delta_rule_naive`.
"""
from __future__ import annotations

import torch


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form: intra-chunk work as matmuls and a unit-triangular solve, a scan over chunks.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g (log decay, <= 0), beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros). Returns (o [B, T, H, V], state [B, H, K, V]).

    Per chunk with start state S0, cumulative log decay G_i = sum_{r<=i} g_r and
    R_ij = exp(G_i - G_j) for j <= i (0 above the diagonal):
        A = I + strict_tril((diag(beta) K K^T) * R)
        U = A^-1 diag(beta) V,   W = A^-1 diag(beta exp(G)) K,   Delta = U - W S0
        O = diag(exp(G)) Q S0 + ((Q K^T) * R) Delta
        S1 = exp(G_C) S0 + (K * exp(G_C - G_j))^T Delta
    The tail is zero-padded (k = 0, beta = 0, g = 0 leave the state untouched). An input
    shorter than `chunk_size` is one chunk of its own length: the [C, C] work of a short
    chunk (a question after a prefix hit) shrinks quadratically instead of being padded.
    """
    b, t, h, dk = q.shape
    chunk_size = max(1, min(chunk_size, t))
    dv = v.shape[-1]
    out_dtype = v.dtype
    pad = (-t) % chunk_size
    n = (t + pad) // chunk_size
    q, k, v = (_to_chunks(x, pad, n, chunk_size) for x in (q, k, v))  # [B, H, N, C, *]
    g, beta = (_to_chunks(x.unsqueeze(-1), pad, n, chunk_size).squeeze(-1) for x in (g, beta))  # [B, H, N, C]

    cum = g.cumsum(-1)  # G: [B, H, N, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # R, built in place (the [.., C, C] tensors dominate memory)
    decay.masked_fill_(~lower, float("-inf")).exp_()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)).mul_(decay).tril_(-1)  # strict part of A (unit diagonal implied)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([dv, dk], dim=-1)  # U [.., C, V], W [.., C, K]
    attn = (q @ k.transpose(-1, -2)).mul_(decay)  # [B, H, N, C, C]
    q_read = q * cum.exp().unsqueeze(-1)
    k_write = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    out = q.new_empty(b, h, n, chunk_size, dv)
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ state  # [B, H, C, V]
        out[:, :, i] = q_read[:, :, i] @ state + attn[:, :, i] @ delta
        state = state * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ delta
    out = out.reshape(b, h, n * chunk_size, dv)[:, :, :t]
    return out.transpose(1, 2).to(out_dtype), state


def _to_chunks(x: torch.Tensor, pad: int, n: int, chunk_size: int) -> torch.Tensor:
    """[B, T, H, D] -> float32 [B, H, N, C, D] with the tail zero-padded: one copy."""
    b, t, h, d = x.shape
    out = x.new_empty(b, h, n * chunk_size, d, dtype=torch.float32)
    out[:, :, :t] = x.transpose(1, 2)
    if pad:
        out[:, :, t:] = 0
    return out.view(b, h, n, chunk_size, d)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form for decode (T is 1 in practice), batched over B sequences.

    Same shapes and result as `chunk_gated_delta_rule`. Decode is memory-bound on the
    state [B, H, K, V], so each token touches it three times only: one batched read
    `[q; k] S` (both projections of the old state in one matmul), then `S *= exp(g)`
    and `S += k d^T` in place. The read-out uses the identity
        o = S_new^T q = exp(g) (S^T q) + (q . k) d
    so it needs no fourth pass. Each token is one `recurrent_gated_delta_rule_` step on a
    copy of `initial_state`, which is never modified.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    if initial_state is None:
        state = q.new_zeros(b, h, dk, dv, dtype=torch.float32)
    else:  # a copy: the in-place step below must not touch the caller's state
        state = initial_state.to(torch.float32, copy=True)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    out = q.new_empty(b, t, h, dv)
    for i in range(t):
        out[:, i] = recurrent_gated_delta_rule_(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], state)
    return out.to(out_dtype), state


def recurrent_gated_delta_rule_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One decode token per sequence, updating `state` in place (no state-sized temporaries).

    q, k [B, H, K], v [B, H, V], g, beta [B, H]; state [B, H, K, V] float32, overwritten with
    the state after the token. Returns o [B, H, V] in v's dtype. Same algebra as
    `recurrent_gated_delta_rule` (one read pass `[q; k] S`, then `S *= exp(g)`, `S += k d^T`).
    """
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    read = torch.stack([q, k], dim=-2) @ state  # [B, H, 2, V]: S^T q and S^T k
    decay = g.exp().unsqueeze(-1)  # [B, H, 1]
    delta = (v - read[:, :, 1] * decay) * beta.unsqueeze(-1)  # [B, H, V]
    state.mul_(decay.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))
    out = read[:, :, 0] * decay + (q * k).sum(-1, keepdim=True) * delta
    return out.to(out_dtype)
