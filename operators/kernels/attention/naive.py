"""The naive reference of paged attention: a double loop (heads, queries) in float64 over
each sequence's gathered K/V (`attention_naive`), and the `PagedAttention` contract over it."""
from __future__ import annotations

from typing import ClassVar

import torch

from vlbatch.operators.kernels.attention.base import PagedAttention
from vlbatch.operators.kernels.attention.layout import PagedLayout


class NaivePagedAttention(PagedAttention):
    """The contract by `attention_naive`, one sequence at a time (slow: tests only)."""

    name: ClassVar[str] = "naive"

    def __call__(self, layout: PagedLayout, k_cache, v_cache, q, k, v, rows=None):
        h_kv, d = k.shape[1], k.shape[2]
        kc, vc = k_cache.view(-1, h_kv, d), v_cache.view(-1, h_kv, d)
        kc.index_copy_(0, layout.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, layout.slot_mapping, v.to(vc.dtype))
        bs, t = layout.block_size, k.shape[0]
        out = torch.zeros(t, q.shape[1], d, dtype=torch.float64)
        wanted = torch.arange(t) if rows is None else rows.cpu()
        full_q = q.new_zeros(t, *q.shape[1:])
        full_q[wanted.to(q.device)] = q
        ends = [c[0] for c in layout.chunks[1:]] + [t]
        for (row0, start, table), row_end in zip(layout.chunks, ends, strict=True):
            pos = torch.arange(start + row_end - row0)
            slots = (torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs).to(kc.device)
            out[row0: row_end] = attention_naive(full_q[row0: row_end].cpu(), kc[slots].cpu(), vc[slots].cpu())
        return out[wanted].float().to(q.device)


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
