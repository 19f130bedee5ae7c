"""The index tensors of one engine step over paged K/V: the input format of `PagedAttention`.

K/V of one full-attention layer live in `k_cache` / `v_cache` `[num_blocks, bs, H_kv, D]`;
token position p of a sequence is at flat slot `table[p // bs] * bs + p % bs`.
`PagedLayout.build` turns a step's (block table, start, end) per sequence into index
tensors once per step (all layers share them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
