"""`ContiguousCache`: the model's own `StepCache` for B sequences in plain tensors.

Owns, for a fixed batch of B sequences (prefill, then decode one token at a time, or
any number of tokens per step):
- full-attention K/V per layer: `[B, H_kv, capacity, D]`, grown by doubling;
- DeltaNet conv `[B, C, K]` (model dtype) and recurrent `[B, H_v, D_k, D_v]` (float32) states;
- `seq_lens` (tokens stored per sequence) and `rope_deltas` (per sequence, set by the
  model at prefill: decode position = seq_len + rope_delta on all three MRoPE axes).

Step protocol: `begin_step(query_lens)`, run the model, `end_step()` (commits the new
lengths). Attention is computed in float32 with `scaled_dot_product_attention`; when
all sequences have the same cached and new lengths they run as one batch, otherwise one
by one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlbatch.operators.errors import InputError
from vlbatch.operators.model.config import TextConfig


class ContiguousCache:
    """Contiguous hybrid cache for B sequences; implements `vlbatch.operators.model.cache.StepCache`."""

    def __init__(
        self,
        cfg: TextConfig,
        batch_size: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        capacity: int = 256,
    ):
        self.cfg, self.batch_size, self.dtype = cfg, batch_size, dtype
        self.device = torch.device(device)
        self.seq_lens = [0] * batch_size
        self.rope_deltas: torch.Tensor | None = None  # [B] long, set at prefill
        self._query_lens: tuple[int, ...] | None = None
        kv_shape = (batch_size, cfg.num_key_value_heads, max(capacity, 1), cfg.head_dim)
        n_full, n_linear = len(cfg.full_layers), len(cfg.linear_layers)
        self.keys = [torch.zeros(kv_shape, dtype=dtype, device=self.device) for _ in range(n_full)]
        self.values = [torch.zeros(kv_shape, dtype=dtype, device=self.device) for _ in range(n_full)]
        conv_shape = (batch_size, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim)
        rec_shape = (batch_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.conv = [torch.zeros(conv_shape, dtype=dtype, device=self.device) for _ in range(n_linear)]
        self.recurrent = [torch.zeros(rec_shape, dtype=torch.float32, device=self.device) for _ in range(n_linear)]

    # -- step protocol -------------------------------------------------------------
    def begin_step(self, query_lens: tuple[int, ...] | list[int]) -> None:
        query_lens = tuple(int(n) for n in query_lens)
        if len(query_lens) != self.batch_size or min(query_lens) < 1:
            raise InputError(f"query_lens must give >= 1 token for each of {self.batch_size} sequences")
        self._query_lens = query_lens
        need = max(p + q for p, q in zip(self.seq_lens, query_lens, strict=True))
        if self.keys and need > self.keys[0].shape[2]:
            self._grow(need)

    def end_step(self) -> None:
        self.seq_lens = [p + q for p, q in zip(self.seq_lens, self.query_lens, strict=True)]
        self._query_lens = None

    @property
    def query_lens(self) -> tuple[int, ...]:
        if self._query_lens is None:
            raise InputError("ContiguousCache: begin_step(query_lens) was not called for this step")
        return self._query_lens

    # -- StepCache -----------------------------------------------------------------
    def attention(self, attn_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H_q, D], k / v [T, H_kv, D] -> [T, H_q, D] (stores k / v first).

        With `rows` [n], q holds only those rows' queries: the others are computed on zeros
        and dropped (this is the reference, not the fast path)."""
        if rows is not None:
            full = q.new_zeros(k.shape[0], *q.shape[1:])
            full[rows] = q
            return self.attention(attn_idx, full, k, v)[rows]
        kc, vc = self.keys[attn_idx], self.values[attn_idx]
        lens, past = self.query_lens, self.seq_lens
        if len(set(lens)) == 1 and len(set(past)) == 1:
            b, n, p = self.batch_size, lens[0], past[0]
            kc[:, :, p : p + n] = k.view(b, n, *k.shape[1:]).transpose(1, 2)
            vc[:, :, p : p + n] = v.view(b, n, *v.shape[1:]).transpose(1, 2)
            out = _attend(q.view(b, n, *q.shape[1:]).transpose(1, 2), kc[:, :, : p + n], vc[:, :, : p + n], p)
            return out.transpose(1, 2).reshape(q.shape)
        out = torch.empty_like(q)
        start = 0
        for i, (n, p) in enumerate(zip(lens, past, strict=True)):
            rows = slice(start, start + n)
            kc[i, :, p : p + n] = k[rows].transpose(0, 1)
            vc[i, :, p : p + n] = v[rows].transpose(0, 1)
            o = _attend(q[rows].transpose(0, 1)[None], kc[i : i + 1, :, : p + n], vc[i : i + 1, :, : p + n], p)
            out[rows] = o[0].transpose(0, 1)
            start += n
        return out

    def linear_states(self, linear_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[linear_idx], self.recurrent[linear_idx]

    def set_linear_states(self, linear_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keeps the tensors given (no copy when dtypes match): the next steps update them in
        place, so a caller seeding states from its own tensors passes copies."""
        self.conv[linear_idx] = conv.to(self.dtype)
        self.recurrent[linear_idx] = recurrent.float()

    def linear_pools(self, linear_idx: int) -> None:
        return None  # `linear_states` hands out the storage itself

    # -- internals -----------------------------------------------------------------
    def _grow(self, need: int) -> None:
        cap = self.keys[0].shape[2]
        while cap < need:
            cap *= 2
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(*old.shape[:2], cap, old.shape[3])
                new[:, :, : old.shape[2]] = old
                store[i] = new


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q [B, H_q, n, D], k / v [B, H_kv, past + n, D] -> [B, H_q, n, D] (causal, GQA, float32)."""
    n = q.shape[2]
    mask = None
    if n > 1 and past > 0:  # query i sees keys 0 .. past + i
        mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(past)
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=n > 1 and past == 0,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.to(q.dtype)
