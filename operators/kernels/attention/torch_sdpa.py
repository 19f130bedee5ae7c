"""Paged attention in torch: gathers and `scaled_dot_product_attention` (the engine's default).

For every full-attention layer `SdpaPagedAttention`:
- writes the new K/V at their slots (`index_copy_`),
- decodes (one query each) together (`attend_single`): gathered K/V `[B, L_max, H_kv, D]`
  with a padding mask, one `scaled_dot_product_attention` call;
- prefill chunks one by one: gathered K/V `[ctx, H_kv, D]`, causal offset by the
  chunk's start (a chunk starting at 0 attends over its own new K/V, no gather).
With `rows` (the last layer: only the rows whose logits are taken) every wanted query is
run the decode way, its context ending at its own position.
Everything is computed in float32 (GQA via `enable_gqa`). On CUDA SDPA dispatches to
PyTorch's fused flash / memory-efficient kernels.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from vlbatch.operators.kernels.attention.base import PagedAttention
from vlbatch.operators.kernels.attention.layout import PagedLayout


class SdpaPagedAttention(PagedAttention):
    """The contract through gathers and SDPA; owns the decode gathers' `Workspace` (one
    instance per engine: its buffers are reused across layers and steps)."""

    name: ClassVar[str] = "sdpa"

    def __init__(self):
        self.workspace = Workspace()

    def __call__(self, layout: PagedLayout, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        h_kv, d = k.shape[1], k.shape[2]
        kc, vc = k_cache.view(-1, h_kv, d), v_cache.view(-1, h_kv, d)
        kc.index_copy_(0, layout.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, layout.slot_mapping, v.to(vc.dtype))
        if rows is not None:
            # built on the host with the layout when the caller named its rows (no device sync)
            slots, mask = layout.row_context or layout.rows_context(rows.tolist())
            return attend_single(kc, vc, q, slots, mask, self.workspace)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        gqa = q.shape[1] != h_kv
        if len(layout.decode_rows):
            out[layout.decode_rows] = self.decode(layout, kc, vc, q[layout.decode_rows])
        for row0, n, start, ctx in layout.prefills:
            qp = q[row0: row0 + n].float().transpose(0, 1)[None]  # [1, H_q, n, D]
            if start == 0 and kc.dtype == k.dtype:  # a first chunk's context is its own new K/V: no gather
                kp = k[row0: row0 + n].float().transpose(0, 1)[None]  # [1, H_kv, n, D]
                vp = v[row0: row0 + n].float().transpose(0, 1)[None]
            else:
                kp = kc.index_select(0, ctx).float().transpose(0, 1)[None]  # [1, H_kv, ctx, D]
                vp = vc.index_select(0, ctx).float().transpose(0, 1)[None]
            mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=gqa)
            out[row0: row0 + n] = o[0].transpose(0, 1)
        return out

    def decode(self, layout: PagedLayout, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The one-token rows: q [B_d, H_q, D], flat caches [S, H_kv, D] -> [B_d, H_q, D] float32
        (a subclass may replace this with a paged kernel)."""
        return attend_single(kc, vc, q, *layout.decode_context, self.workspace)


class Workspace:
    """Reusable buffers for the decode gathers, one per name, grown as needed: a fresh
    multi-MB tensor per layer and step costs page faults that rival the copy itself.
    A buffer is only valid until the next `get` of its name."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


def attend_single(kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """One query per row over its context: q [n, H_q, D], flat caches [S, H_kv, D], context
    slots [n, L] with mask [n, 1, 1, L] -> [n, H_q, D] float32 (one attention call)."""
    n, length = slots.shape
    h_kv, d = kc.shape[1], kc.shape[2]
    flat = slots.reshape(-1)  # index_select copies whole [H_kv, D] rows: ~3x faster than kc[slots]
    ws = workspace or Workspace()
    kd = torch.index_select(kc, 0, flat, out=ws.get("k", (n * length, h_kv, d), kc))
    vd = torch.index_select(vc, 0, flat, out=ws.get("v", (n * length, h_kv, d), vc))
    kd = kd.view(n, length, h_kv, d).float().transpose(1, 2)  # [n, H_kv, L, D]
    vd = vd.view(n, length, h_kv, d).float().transpose(1, 2)
    o = F.scaled_dot_product_attention(q.float().unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=q.shape[1] != h_kv)
    return o.squeeze(2)
