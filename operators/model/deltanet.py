"""Gated DeltaNet mixer (seed 000 section 9) over packed sequences.

Per token: `in_proj_qkv` -> causal depthwise conv (kernel K, SiLU) over the sequence ->
split q [H_k, D_k], k [H_k, D_k], v [H_v, D_v]; q / k L2-normalised (eps 1e-6), expanded
to H_v heads (repeat_interleave: k head i serves v heads i*r .. i*r + r - 1), q scaled by
1/sqrt(D_k). beta = sigmoid(in_proj_b x), g = -exp(A_log) * softplus(in_proj_a x + dt_bias)
in float32. The gated delta rule gives o [H_v, D_v]; `GatedRMSNorm(o, z = in_proj_z x)`
then `out_proj`. After `fuse_()` (a load-time transform) the qkv and z projections run
as one matmul.

Packing: the step's tokens are [T, D] in `cache.query_lens` order. Sequences with one
new token (decode) run together through the single-step conv and the recurrent rule,
which updates the recurrent states in place (the engine's pool rows, when the step's
slots are consecutive); all longer chunks, whatever their lengths, run together through
the packed conv and the packed chunked rule. When the step has decodes and the cache
exposes its pools (`cache.linear_pools`), decodes update their pool rows by slot index and
only the chunks' states are gathered and stored back. The rule itself is `self.kernels`
(`operators/kernels/delta_rule`: the torch kernels, or fla's on CUDA; `load_model` picks
them once through `Qwen35Model.use_delta_kernels`). States in and out go through
`cache.linear_states` / `cache.set_linear_states`.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels
from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule
from vlbatch.operators.model.cache import StepCache
from vlbatch.operators.model.config import TextConfig
from vlbatch.operators.model.layers import GatedRMSNorm, fuse_linears, fused_buffers
from vlbatch.operators.model.ops import heads_cpu
from vlbatch.operators.model.ops.conv import (
    causal_conv1d_packed,
    causal_conv1d_step,
    causal_conv1d_step_slots,
)


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
        self.kernels: DeltaRuleKernels = TorchDeltaRule()
        fused_buffers(self)

    def fuse_(self) -> None:
        """qkv and z projections as one matmul (a load-time transform). b and a stay
        separate: an H_v-wide matmul rounds differently inside a wider one, and the decay
        path amplifies that (their cost is negligible)."""
        fuse_linears(self, [self.in_proj_qkv, self.in_proj_z])

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> qkv [T, C], z [T, V], b, a [T, H_v] (separate projections; `fuse_`
        swaps in `_project_fused` once, at load)."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def _project_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """As `_project`, qkv and z views of one matmul."""
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        qkv, z = F.linear(x, self.fused_weight).split([self.conv_dim, self.value_dim], dim=-1)
        return qkv, z, b, a

    def forward(self, x: torch.Tensor, cache: StepCache, linear_idx: int,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D], or [n, D] for rows `keep` [n] (the states still see every row)."""
        t = x.shape[0]
        qkv, z, b, a = self._project(x)
        z = z.reshape(t, self.n_v, self.d_v)
        beta = torch.sigmoid(b).float()  # [T, H_v]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        lens = tuple(cache.query_lens)
        pools = cache.linear_pools(linear_idx) if min(lens) == 1 else None
        if pools is not None:  # decodes over scattered slots: states updated where the pools keep them
            out = (self._decode_pooled(qkv, g, beta, *pools) if max(lens) == 1
                   else self._mixed(qkv, g, beta, *pools, lens))
        else:
            conv_state, rec_state = cache.linear_states(linear_idx)
            if max(lens) == 1:
                out, conv_new, rec_new = self._decode(qkv, g, beta, conv_state, rec_state)
            elif min(lens) > 1:
                out, conv_new, rec_new = self._prefill(qkv, g, beta, conv_state, rec_state, lens)
            else:  # the step's own states as the pools (updated in place), then stored
                conv_new, rec_new = conv_state, rec_state
                out = self._mixed(qkv, g, beta, conv_state, rec_state, torch.arange(len(lens), device=qkv.device), lens)
            cache.set_linear_states(linear_idx, conv_new, rec_new)
        if keep is not None:
            out, z = out[keep], z[keep]
        out = self.norm(out, z)
        return self.out_proj(out.reshape(out.shape[0], self.value_dim))

    def _decode(self, qkv, g, beta, conv_state, rec_state):
        """One token per sequence: qkv [B, C] -> o [B, H_v, D_v]; `rec_state` is updated in place,
        and so may `conv_state` be (returned as `conv_new` then)."""
        weight = self.conv1d.weight.view(self.conv_dim, self.kernel)
        mixed, conv_new = causal_conv1d_step(qkv, weight, conv_state, inplace=True)  # [B, C]
        q, k, v = self._heads(mixed)
        out = self.kernels.decode_(q, k, v, g, beta, rec_state)
        return out, conv_new, rec_state

    def _decode_pooled(self, qkv, g, beta, conv_pool, rec_pool, slots):
        """As `_decode` on the states conv_pool[slots] / rec_pool[slots], updated in the pools."""
        weight = self.conv1d.weight.view(self.conv_dim, self.kernel)
        mixed = causal_conv1d_step_slots(qkv, weight, conv_pool, slots)  # [B, C]
        q, k, v = self._heads(mixed)
        return self.kernels.decode_slots_(q, k, v, g, beta, rec_pool, slots)

    def _prefill(self, qkv, g, beta, conv_state, rec_state, lens: tuple[int, ...]):
        """Chunks of any lengths (packed [T, C]) -> o [T, H_v, D_v] + new states."""
        weight = self.conv1d.weight.view(self.conv_dim, self.kernel)
        mixed, conv_new = causal_conv1d_packed(qkv, weight, conv_state, lens)  # [T, C]
        q, k, v = self._heads(mixed)
        out, rec_new = self.kernels.prefill(q, k, v, g, beta, rec_state, lens)
        return out, conv_new, rec_new

    def _mixed(self, qkv, g, beta, conv_pool, rec_pool, slots, lens: tuple[int, ...]):
        """Decodes and longer chunks in one step, each kind through its own path, on the states
        conv_pool[slots] / rec_pool[slots] (slots [B] in packing order), updated in the pools: the
        decodes in place by index, the chunks' states gathered, advanced and stored back (no
        copy of the other sequences' states). The scheduler packs running decodes before the
        chunks, so each kind is usually one run of rows: a slice, not a gather."""
        dev = qkv.device
        starts = [0, *itertools.accumulate(lens)]
        dec = [i for i, n in enumerate(lens) if n == 1]
        pre = [i for i, n in enumerate(lens) if n > 1]
        out = qkv.new_empty(qkv.shape[0], self.n_v, self.d_v)
        seqs = range(len(lens) + 1)  # sequence i is slot row i
        rows = _rows(starts, dec, dev)
        out[rows] = self._decode_pooled(qkv[rows], g[rows], beta[rows], conv_pool, rec_pool,
                                        slots[_rows(seqs, dec, dev)]).to(out.dtype)
        rows = _rows(starts, pre, dev)
        sel = slots[_rows(seqs, pre, dev)]
        o, c, r = self._prefill(qkv[rows], g[rows], beta[rows], conv_pool.index_select(0, sel),
                                rec_pool.index_select(0, sel), tuple(lens[i] for i in pre))
        out[rows] = o.to(out.dtype)
        conv_pool.index_copy_(0, sel, c.to(conv_pool.dtype))
        rec_pool.index_copy_(0, sel, r.to(rec_pool.dtype))
        return out

    def _heads(self, mixed: torch.Tensor):
        """mixed [T, C] (after conv) -> q, k [T, H_v, D_k] float32 (L2-normalised, expanded, q
        scaled: one compiled pass on CPU float32, `ops/heads_cpu.py`), v [T, H_v, D_v]."""
        qk, v = mixed.split([2 * self.key_dim, self.value_dim], dim=-1)
        heads = heads_cpu.qk_heads_cpu if heads_cpu.usable(qk) else heads_cpu.qk_heads_torch
        q, k = heads(qk, self.n_k, self.n_v, self.d_k, self.d_k**-0.5)
        return q, k, v.reshape(mixed.shape[0], self.n_v, self.d_v)


def _rows(starts, seqs: list[int], device) -> slice | torch.Tensor:
    """The rows of sequences `seqs` (ascending; sequence i holds rows starts[i] .. starts[i + 1] - 1):
    a slice when the sequences are adjacent (a view, no gather), else [n] long."""
    if seqs[-1] - seqs[0] == len(seqs) - 1:
        return slice(starts[seqs[0]], starts[seqs[-1] + 1])
    return torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]).to(device)
