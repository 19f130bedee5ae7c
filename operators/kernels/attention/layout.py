"""The index tensors of one engine step over paged K/V: the input format of `PagedAttention`.

K/V of one full-attention layer live in `k_cache` / `v_cache` `[num_blocks, bs, H_kv, D]`;
token position p of a sequence is at flat slot `table[p // bs] * bs + p % bs`.
`PagedLayout.build` turns a step's (block table, start, end) per sequence into index
tensors once per step (all layers share them), on the host, and copies them to the device
without waiting on it (`to_device`). Decode rows are block tables with context lengths (what
a paged kernel reads); the flat context slots and mask of the gather + SDPA path are derived
from them on the device the first time a backend asks (`decode_context`), so a step whose
backend reads tables builds no `[B, L_max]` tensors on the host and copies none.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory without blocking the host
    (a pageable copy first waits for the device's queue to drain)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class PagedLayout:
    """Index tensors of one step. rows: packed query rows; slots: flat cache slots."""

    slot_mapping: torch.Tensor  # [T] slot of each new token
    decode_rows: torch.Tensor  # [B_d] packed row of each one-token sequence
    prefills: tuple[tuple[int, int, int, torch.Tensor], ...]  # (row0, n, start, ctx slots [start + n])
    chunks: tuple[tuple[int, int, list[int]], ...]  # (row0, start, block table) of every sequence
    block_size: int
    decode_tables: torch.Tensor  # [B_d, W] int32 block tables (padded with 0)
    decode_lens: torch.Tensor  # [B_d] int32 context length (new token included)
    decode_width: int  # L_max <= W * block_size: context columns of `decode_context` (>= every length)
    row_context: tuple[torch.Tensor, torch.Tensor] | None = None  # `rows_context(rows)` of the sampled rows

    @cached_property
    def decode_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Context slots [B_d, L_max] (0 past each length) and mask [B_d, 1, 1, L_max] of the decode
        rows, made on first use from `decode_tables` / `decode_lens` on their device (device ops
        only: inside a captured graph too)."""
        return context_slots(self.decode_tables, self.decode_lens, self.block_size, self.decode_width)

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], ends: list[int], block_size: int,
              device, rows: list[int] | None = None) -> PagedLayout:
        """`rows` (ascending packed rows, optional): the rows the caller will pass as `rows`
        to the attention; their context is then built here, on the host."""
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
                d_tables.append(table[: -(-e // bs)])
                d_lens.append(e)
            else:
                if pending:
                    mapping.append(torch.tensor(pending, dtype=torch.long))
                    pending = []
                blocks = torch.tensor(table, dtype=torch.long)
                pos = torch.arange(e)
                ctx = blocks[pos // bs] * bs + pos % bs  # [e]
                mapping.append(ctx[s:])
                prefills.append((row, e - s, s, to_device(ctx, device)))
            row += e - s
        if pending:
            mapping.append(torch.tensor(pending, dtype=torch.long))
        d_tab = padded_tables(d_tables, max((len(t) for t in d_tables), default=0))
        layout = cls(to_device(torch.cat(mapping), device), to_device(torch.tensor(d_rows, dtype=torch.long), device),
                     tuple(prefills), tuple(chunks), bs, to_device(d_tab, device),
                     to_device(torch.tensor(d_lens, dtype=torch.int32), device), max(d_lens, default=0))
        if rows is None:
            return layout
        return replace(layout, row_context=layout.rows_context(rows))

    def rows_context(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Context slots [n, L_max] and mask [n, 1, 1, L_max] of packed rows `rows` (ascending)."""
        tables, lens, i = [], [], 0
        for r in rows:
            while i + 1 < len(self.chunks) and self.chunks[i + 1][0] <= r:
                i += 1
            row0, start, table = self.chunks[i]
            tables.append(table)
            lens.append(start + r - row0 + 1)
        slots, mask = decode_slots(tables, lens, self.block_size)
        dev = self.slot_mapping.device
        return to_device(slots, dev), to_device(mask, dev)


def padded_tables(tables: list[list[int]], width: int) -> torch.Tensor:
    """[B, width] int32 block tables, padded with 0 (blocks past a row's length are never read)."""
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(len(tables), width)


def decode_slots(tables: list[list[int]], lens: list[int], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host lists -> context slots [B, L_max] and mask [B, 1, 1, L_max] (`context_slots`, L_max the
    longest length)."""
    width = max((len(t) for t in tables), default=0)
    return context_slots(padded_tables(tables, width), torch.tensor(lens, dtype=torch.int32), bs, max(lens, default=0))


def context_slots(tables: torch.Tensor, lens: torch.Tensor, bs: int, lmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [B, W] (int, W * bs >= lmax) and context lengths [B] (<= lmax) -> flat context
    slots [B, lmax] long (`table[p // bs] * bs + p % bs`, 0 past each length) and mask
    [B, 1, 1, lmax] (True where a real context slot), on the tables' device."""
    pos = torch.arange(lmax, device=tables.device)
    mask = pos[None] < lens[:, None].long()  # [B, lmax]
    slots = tables.long()[:, pos // bs] * bs + pos % bs
    return slots.masked_fill(~mask, 0), mask[:, None, None, :]
