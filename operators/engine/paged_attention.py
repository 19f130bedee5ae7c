"""Attention over paged K/V (torch path) and its naive reference.

K/V of one full-attention layer live in `k_cache` / `v_cache` `[num_blocks, bs, H_kv, D]`;
token position p of a sequence is at flat slot `table[p // bs] * bs + p % bs`.
`PagedLayout` turns a step's (block table, start, end) per sequence into index tensors
once per step; `paged_attention` then, for every full-attention layer:
- writes the new K/V at their slots (`index_copy_`),
- decodes (one query each) together (`attend_single`): gathered K/V `[B, L_max, H_kv, D]`
  with a padding mask, one `scaled_dot_product_attention` call;
- prefill chunks one by one: gathered K/V `[ctx, H_kv, D]`, causal offset by the
  chunk's start.
With `rows` (the last layer: only the rows whose logits are taken) every wanted query is
run the decode way, its context ending at its own position.
Everything is computed in float32 (GQA via `enable_gqa`). A fused paged kernel could
replace this function with the same arguments; `attention_naive` is the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PagedLayout:
    """Index tensors of one step. rows: packed query rows; slots: flat cache slots."""

    slot_mapping: torch.Tensor  # [T] slot of each new token
    decode_rows: torch.Tensor  # [B_d] packed row of each one-token sequence
    decode_slots: torch.Tensor  # [B_d, L_max] slots of its context (padded with 0)
    decode_mask: torch.Tensor  # [B_d, 1, 1, L_max] True where a real context slot
    prefills: tuple[tuple[int, int, int, torch.Tensor], ...]  # (row0, n, start, ctx slots [start + n])
    chunks: tuple[tuple[int, int, list[int]], ...]  # (row0, start, block table) of every sequence
    block_size: int

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], ends: list[int], block_size: int,
              device) -> PagedLayout:
        bs = block_size
        mapping: list[torch.Tensor] = []
        pending: list[int] = []  # slots of consecutive one-token rows, flushed as one tensor
        d_rows, d_tables, d_lens, prefills, chunks = [], [], [], [], []
        row = 0
        for table, s, e in zip(tables, starts, ends, strict=False):
            chunks.append((row, s, table))
            if e - s == 1:  # decode: its new slot in Python, its context below in one batched op
                pending.append(table[s // bs] * bs + s % bs)
                d_rows.append(row)
                d_tables.append(table)
                d_lens.append(e)
            else:
                if pending:
                    mapping.append(torch.tensor(pending, dtype=torch.long))
                    pending = []
                blocks = torch.tensor(table, dtype=torch.long)
                pos = torch.arange(e)
                ctx = blocks[pos // bs] * bs + pos % bs  # [e]
                mapping.append(ctx[s:])
                prefills.append((row, e - s, s, ctx.to(device)))
            row += e - s
        if pending:
            mapping.append(torch.tensor(pending, dtype=torch.long))
        slots, mask = _decode_slots(d_tables, d_lens, bs)
        return cls(torch.cat(mapping).to(device), torch.tensor(d_rows, dtype=torch.long, device=device),
                   slots.to(device), mask.to(device), tuple(prefills), tuple(chunks), bs)

    def rows_context(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Context slots [n, L_max] and mask [n, 1, 1, L_max] of packed rows `rows` (ascending)."""
        tables, lens, i = [], [], 0
        for r in rows:
            while i + 1 < len(self.chunks) and self.chunks[i + 1][0] <= r:
                i += 1
            row0, start, table = self.chunks[i]
            tables.append(table)
            lens.append(start + r - row0 + 1)
        slots, mask = _decode_slots(tables, lens, self.block_size)
        dev = self.slot_mapping.device
        return slots.to(dev), mask.to(dev)


def _decode_slots(tables: list[list[int]], lens: list[int], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context slots [B, L_max] (0 past each length) and mask [B, 1, 1, L_max] of decode rows."""
    lmax = max(lens, default=0)
    width = max((len(t) for t in tables), default=0)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(len(tables), width)
    pos = torch.arange(lmax)
    mask = pos[None] < torch.tensor(lens, dtype=torch.long)[:, None]  # [B, L_max]
    slots = padded[:, pos // bs] * bs + pos % bs if len(tables) else torch.zeros(0, lmax, dtype=torch.long)
    return slots.masked_fill(~mask, 0), mask[:, None, None, :]


def paged_attention(layout: PagedLayout, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None,
                    workspace: Workspace | None = None) -> torch.Tensor:
    """q [T, H_q, D] (or [n, H_q, D] for `rows` [n]), k / v [T, H_kv, D]; caches
    [num_blocks, bs, H_kv, D] -> out [T, H_q, D] (or [n, H_q, D]), float32."""
    h_kv, d = k.shape[1], k.shape[2]
    kc, vc = k_cache.view(-1, h_kv, d), v_cache.view(-1, h_kv, d)
    kc.index_copy_(0, layout.slot_mapping, k.to(kc.dtype))
    vc.index_copy_(0, layout.slot_mapping, v.to(vc.dtype))
    if rows is not None:
        slots, mask = layout.rows_context(rows.tolist())
        return attend_single(kc, vc, q, slots, mask, workspace)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    gqa = q.shape[1] != h_kv
    if len(layout.decode_rows):
        out[layout.decode_rows] = attend_single(kc, vc, q[layout.decode_rows], layout.decode_slots,
                                                layout.decode_mask, workspace)
    for row0, n, start, ctx in layout.prefills:
        qp = q[row0: row0 + n].float().transpose(0, 1)[None]  # [1, H_q, n, D]
        kp = kc.index_select(0, ctx).float().transpose(0, 1)[None]  # [1, H_kv, ctx, D]
        vp = vc.index_select(0, ctx).float().transpose(0, 1)[None]
        mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=gqa)
        out[row0: row0 + n] = o[0].transpose(0, 1)
    return out


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


def attention_naive(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
    """Reference for one sequence: q [n, H_q, D] are the last n of k_all / v_all [ctx, H_kv, D]."""
    n, hq, d = q.shape
    ctx, hkv = k_all.shape[0], k_all.shape[1]
    rep = hq // hkv
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k_all[:, h // rep].double(), v_all[:, h // rep].double()
        for i in range(n):
            last = ctx - n + i
            s = (kh[: last + 1] @ q[i, h].double()) / d**0.5
            out[i, h] = torch.softmax(s, 0) @ vh[: last + 1]
    return out
