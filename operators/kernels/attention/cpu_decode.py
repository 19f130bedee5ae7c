"""Paged decode attention on the CPU as one compiled pass over the block tables (numba).

`CpuPagedAttention` is `SdpaPagedAttention` with its one-token rows by `paged_decode_cpu`
(prefill chunks and `rows` calls stay on the SDPA path). The gather path copies every
decode row's whole context into a contiguous `[B, L_max, H_kv, D]` tensor per layer and
step before attending; here each (sequence, kv head) reads its K/V rows in place, block by
block through the sequence's table, for all `H_q / H_kv` query heads it serves (GQA):

    s[g, p] = q[g] . k[p] / sqrt(D)        p < len, k[p] at table[p // bs], row p % bs
    out[g] = sum_p softmax(s[g])[p] v[p]

float32 throughout (scores, softmax, sums), like the SDPA path it replaces; the softmax's
exp is `softmax_exp_` below (vectorised; numba's `np.exp` is a scalar libm call here). `usable` says
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
    bits = np.empty(lmax, dtype=np.int32)  # softmax_exp_'s scratch
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
                total = softmax_exp_(s[g], n, bits)  # s[g, :n] = exp(s - max)
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


# The softmax's exp, written so the loop vectoriser handles it. numba's `np.exp` in a loop is
# a scalar libm `expf` per element unless Intel's SVML is installed (it is not here): a third of
# the kernel's time. exp(s - max) as Cephes' expf computes it, in straight-line float32:
#     x = max(s - m, -87);  k = round(x / ln 2);  r = x - k ln2_hi - k ln2_lo   (|r| <= ln2 / 2)
#     exp(r) = 1 + r + r^2 P(r) (degree-5 polynomial);  exp(x) = exp(r) * 2^k (k added to the exponent bits)
# Within 3e-7 (relative) of float64 exp over [-87, 0]; scores more than 87 below the row's
# largest weigh exp(-87) = 1.6e-38 instead of less: nothing a float32 sum holding 1.0 can see.
# Kept in this file: numba's cache does not notice a change to a compiled function of another file.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that k * _LN2_HI is exact for |k| < 2^8
_LN2_LO = np.float32(-2.12194440e-4)
_P = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
      np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))


@njit(cache=True, nogil=True, boundscheck=False, fastmath=True, inline="always")
def softmax_exp_(s, n, bits):
    """s [>= n] float32 (contiguous) scores -> s[:n] = exp(s - max(s[:n])), returns their sum;
    bits [>= n] int32 scratch."""
    m = s[0]
    for p in range(1, n):
        m = max(m, s[p])
    for p in range(n):
        x = max(s[p] - m, np.float32(-87.0))
        k = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - k * _LN2_HI - k * _LN2_LO
        y = _P[0] * r + _P[1]
        y = y * r + _P[2]
        y = y * r + _P[3]
        y = y * r + _P[4]
        y = y * r + _P[5]
        s[p] = y * r * r + r + np.float32(1.0)
        bits[p] = np.int32(k) << 23
    as_int = s.view(np.int32)
    for p in range(n):
        as_int[p] += bits[p]  # * 2^k: k >= -126, so the result stays a normal float
    total = np.float32(0.0)
    for p in range(n):
        total += s[p]
    return total


@njit(cache=True, nogil=True, boundscheck=False)
def _exp_twin(s, n, bits):
    """The naive twin of `softmax_exp_` (libm exp), for the tests."""
    m = s[0]
    for p in range(1, n):
        m = max(m, s[p])
    total = np.float32(0.0)
    for p in range(n):
        s[p] = np.exp(s[p] - m)
        total += s[p]
    return total


class CpuPagedAttention(SdpaPagedAttention):
    """`base.PagedAttention` with decode rows by `paged_decode_cpu` when the caches are
    `usable`; everything else as `SdpaPagedAttention`."""

    name: ClassVar[str] = "cpu"

    def __init__(self):
        super().__init__()
        warm_up()

    def decode(self, layout: PagedLayout, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if not usable(kc):
            return super().decode(layout, kc, vc, q)
        shape = (-1, layout.block_size, kc.shape[1], kc.shape[2])
        return paged_decode_cpu(q, kc.view(shape), vc.view(shape), layout.decode_tables, layout.decode_lens)
