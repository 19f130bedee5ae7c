"""Paged decode attention on the CPU as one compiled pass over the block tables (numba).

`CpuPagedAttention` is `SdpaPagedAttention` with its one-token rows by `paged_decode_cpu`
(prefill chunks and `rows` calls stay on the SDPA path). The gather path copies every
decode row's whole context into a contiguous `[B, L_max, H_kv, D]` tensor per layer and
step before attending; here each (sequence, kv head) reads its K/V rows in place, block by
block through the sequence's table, for all `H_q / H_kv` query heads it serves (GQA):

    s[g, p] = q[g] . k[p] / sqrt(D)        p < len, k[p] at table[p // bs], row p % bs
    out[g] = sum_p softmax(s[g])[p] v[p]

float32 throughout (scores, softmax, sums), like the SDPA path it replaces. `usable` says
when it applies (float32 CPU caches); other dtypes take the gather path. Tested against
`naive.attention_naive` at odd shapes (tests/test_kernels_attention_cpu.py).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from numba import njit

from vlbatch.operators.kernels.attention.layout import PagedLayout
from vlbatch.operators.kernels.attention.torch_sdpa import SdpaPagedAttention


def usable(kc: torch.Tensor) -> bool:
    """The compiled pass reads the cache through numpy: CPU, float32, C-contiguous."""
    return kc.device.type == "cpu" and kc.dtype == torch.float32 and kc.is_contiguous()


def warm_up() -> None:
    """Load (or, the first time on a machine, compile and cache) the kernel at engine build."""
    paged_decode_cpu(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1),
                     torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor) -> torch.Tensor:
    """q [B, H_q, D]; k_cache / v_cache [num_blocks, bs, H_kv, D] float32 (`usable`); tables
    [B, W] int32 block tables; lens [B] int32 context lengths (>= 1, the new token's K/V
    already stored) -> out [B, H_q, D] float32: each query over positions 0..len-1."""
    b, hq, d = q.shape
    out = torch.empty(b, hq, d, dtype=torch.float32)
    if b == 0:
        return out
    qn = q.detach().to(torch.float32).contiguous().numpy()
    _kernel(qn, k_cache.detach().numpy(), v_cache.detach().numpy(), tables.to(torch.int32).contiguous().numpy(),
            lens.to(torch.int32).contiguous().numpy(), out.numpy(), np.float32(d**-0.5))
    return out


@njit(cache=True, nogil=True, boundscheck=False, fastmath=True)
def _kernel(q, kc, vc, tables, lens, out, scale):  # shapes as `paged_decode_cpu`
    b, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    group = hq // hkv
    lmax = 0
    for i in range(b):
        lmax = max(lmax, lens[i])
    s = np.empty((group, lmax), dtype=np.float32)  # scores, then weights, of one kv head's queries
    acc = np.empty((group, d), dtype=np.float32)
    for i in range(b):
        n = lens[i]
        nblk = (n + bs - 1) // bs
        for h in range(hkv):
            h0 = h * group
            for t in range(nblk):  # block by block through the table; each K row read once for G heads
                blk = tables[i, t]
                for o in range(min(bs, n - t * bs)):
                    p = t * bs + o
                    for g in range(group):
                        dot = np.float32(0.0)
                        for j in range(d):
                            dot += q[i, h0 + g, j] * kc[blk, o, h, j]
                        s[g, p] = dot * scale
            for g in range(group):
                m = s[g, 0]
                for p in range(1, n):
                    m = max(m, s[g, p])
                total = np.float32(0.0)
                for p in range(n):
                    e = np.exp(s[g, p] - m)
                    s[g, p] = e
                    total += e
                inv = np.float32(1.0) / total
                for p in range(n):
                    s[g, p] *= inv
            acc[:] = 0.0
            for t in range(nblk):  # each V row read once for the G query heads
                blk = tables[i, t]
                for o in range(min(bs, n - t * bs)):
                    p = t * bs + o
                    for g in range(group):
                        w = s[g, p]
                        for j in range(d):
                            acc[g, j] += w * vc[blk, o, h, j]
            for g in range(group):
                for j in range(d):
                    out[i, h0 + g, j] = acc[g, j]


class CpuPagedAttention(SdpaPagedAttention):
    """`base.PagedAttention` with decode rows by `paged_decode_cpu` when the caches are
    `usable`; everything else as `SdpaPagedAttention`."""

    name: ClassVar[str] = "cpu"

    def __init__(self):
        super().__init__()
        warm_up()

    def decode(self, layout: PagedLayout, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if not usable(kc) or layout.decode_tables is None:
            return super().decode(layout, kc, vc, q)
        shape = (-1, layout.block_size, kc.shape[1], kc.shape[2])
        return paged_decode_cpu(q, kc.view(shape), vc.view(shape), layout.decode_tables, layout.decode_lens)
