"""Gated DeltaNet mixer (seed 000 section 9) over packed sequences.

Per token: `in_proj_qkv` -> causal depthwise conv (kernel K, SiLU) over the sequence ->
split q [H_k, D_k], k [H_k, D_k], v [H_v, D_v]; q / k L2-normalised (eps 1e-6), expanded
to H_v heads (repeat_interleave: k head i serves v heads i*r .. i*r + r - 1), q scaled by
1/sqrt(D_k). beta = sigmoid(in_proj_b x), g = -exp(A_log) * softplus(in_proj_a x + dt_bias)
in float32. The gated delta rule gives o [H_v, D_v]; `GatedRMSNorm(o, z = in_proj_z x)`
then `out_proj`.

Packing: the step's tokens are [T, D] in `cache.query_lens` order. Sequences with one
new token are run together through the single-step conv and recurrent rule (decode,
batched over them); when every sequence brings the same L > 1 tokens they run together
through the chunked rule. In a ragged step, chunks of at most `SHORT` tokens (a
sibling's question after a prefix hit, a chunked prefill's tail) run together,
right-padded to the longest; longer chunks run together by equal length.
States in and out go through `cache.linear_states` / `cache.set_linear_states`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from operators.model.cache import StepCache
from operators.model.config import TextConfig
from operators.model.layers import GatedRMSNorm
from operators.model.ops.conv import causal_conv1d_prefill, causal_conv1d_step
from operators.model.ops.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

SHORT = 64  # chunks up to this many tokens fit one delta-rule chunk: batched together, padded


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """[T, D_model] packed tokens -> [T, D_model]; parameter names as in the checkpoint."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.conv_dim, self.kernel = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.d_v, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.n_v, bias=False)

    def forward(self, x: torch.Tensor, cache: StepCache, linear_idx: int) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.in_proj_qkv(x)  # [T, C]
        z = self.in_proj_z(x).view(t, self.n_v, self.d_v)
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [T, H_v]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        conv_state, rec_state = cache.linear_states(linear_idx)
        lens = tuple(cache.query_lens)
        if all(n == lens[0] for n in lens):
            out, conv_new, rec_new = self._uniform(qkv, g, beta, conv_state, rec_state, lens[0])
        else:
            out, conv_new, rec_new = self._ragged(qkv, g, beta, conv_state, rec_state, lens)
        cache.set_linear_states(linear_idx, conv_new, rec_new)
        out = self.norm(out.reshape(t, self.n_v, self.d_v), z)
        return self.out_proj(out.reshape(t, self.value_dim))

    def _uniform(self, qkv, g, beta, conv_state, rec_state, length: int):
        """B sequences of `length` tokens each: qkv [B * L, C] -> o [B * L, H_v, D_v] + states."""
        b = conv_state.shape[0]
        weight = self.conv1d.weight.view(self.conv_dim, self.kernel)
        if length == 1:
            mixed, conv_new = causal_conv1d_step(qkv, weight, conv_state)
            mixed = mixed.unsqueeze(1)  # [B, 1, C]
        else:
            mixed, conv_new = causal_conv1d_prefill(qkv.view(b, length, -1).transpose(1, 2), weight, conv_state)
            mixed = mixed.transpose(1, 2)  # [B, L, C]
        out, rec_new = self._delta(mixed, g.view(b, length, -1), beta.view(b, length, -1), rec_state)
        return out.reshape(b * length, self.n_v, self.d_v), conv_new, rec_new

    def _ragged(self, qkv, g, beta, conv_state, rec_state, lens: tuple[int, ...]):
        """Sequences of different lengths: decodes batched together; chunks of at most
        `SHORT` tokens batched together, right-padded to the longest (`_padded`); longer
        chunks batched by equal length."""
        starts = [sum(lens[:i]) for i in range(len(lens))]
        out = qkv.new_empty(qkv.shape[0], self.n_v, self.d_v)
        conv_new, rec_new = torch.empty_like(conv_state), torch.empty_like(rec_state)  # the groups fill every row
        groups: dict[int, list[int]] = {}  # 1: decodes, 0: short chunks, n: long chunks of n tokens
        for i, n in enumerate(lens):
            groups.setdefault(1 if n == 1 else 0 if n <= SHORT else n, []).append(i)
        for key, seqs in groups.items():
            sel = torch.tensor(seqs, device=qkv.device)
            if key == 0 and len(seqs) > 1:
                self._padded(qkv, g, beta, conv_state, rec_state, [starts[i] for i in seqs],
                             [lens[i] for i in seqs], sel, out, conv_new, rec_new)
                continue
            length = lens[seqs[0]]
            rows = (torch.tensor([starts[i] for i in seqs], device=qkv.device)[:, None]
                    + torch.arange(length, device=qkv.device)).view(-1)  # [B * L], sequence-major
            o, c, r = self._uniform(qkv[rows], g[rows], beta[rows], conv_state[sel], rec_state[sel], length)
            out[rows] = o
            conv_new[sel], rec_new[sel] = c.to(conv_new.dtype), r
        return out, conv_new, rec_new

    def _padded(self, qkv, g, beta, conv_state, rec_state, starts, lens, sel, out, conv_new, rec_new):
        """Short chunks of different lengths in one batch, right-padded to the longest M.

        Padding rows get g = 0 and beta = 0, which leave the recurrent state untouched
        (the chunked rule pads its tail the same way); the conv state is taken at each
        sequence's own end. Writes the real rows into `out` and the states into
        `conv_new` / `rec_new` at `sel`."""
        b, m = len(lens), max(lens)
        lengths = torch.tensor(lens, device=qkv.device)
        valid = torch.arange(m, device=qkv.device)[None] < lengths[:, None]  # [B, M]
        rows = (torch.tensor(starts, device=qkv.device)[:, None] + torch.arange(m, device=qkv.device))[valid]
        x = qkv.new_zeros(b, m, qkv.shape[1])
        x[valid] = qkv[rows]
        gp, bp = g.new_zeros(b, m, g.shape[1]), beta.new_zeros(b, m, beta.shape[1])
        gp[valid], bp[valid] = g[rows], beta[rows]
        weight = self.conv1d.weight.view(self.conv_dim, self.kernel)
        mixed, c = causal_conv1d_prefill(x.transpose(1, 2), weight, conv_state[sel], lengths)
        o, r = self._delta(mixed.transpose(1, 2), gp, bp, rec_state[sel])  # o [B, M, H_v, D_v]
        out[rows] = o[valid]
        conv_new[sel], rec_new[sel] = c.to(conv_new.dtype), r

    def _delta(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor):
        """mixed [B, L, C] (after conv) -> o [B, L, H_v, D_v], state [B, H_v, D_k, D_v]."""
        b, length, _ = mixed.shape
        qk, v = mixed.split([2 * self.key_dim, self.value_dim], dim=-1)
        qk = l2norm(qk.reshape(b, length, 2, self.n_k, self.d_k).float())  # q and k in one pass
        if self.n_v != self.n_k:
            qk = qk.repeat_interleave(self.n_v // self.n_k, dim=3)
        q, k = qk.unbind(2)
        q = q * self.d_k**-0.5
        v = v.reshape(b, length, self.n_v, self.d_v)
        rule = recurrent_gated_delta_rule if length == 1 else chunk_gated_delta_rule
        return rule(q, k, v, g, beta, state)
