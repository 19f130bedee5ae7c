"""Paged decode attention as one Triton kernel (`TritonPagedAttention`: SDPA's contract, its
one-token rows by the kernel; prefill chunks and `rows` calls stay on the SDPA path).

`paged_decode(q, k_cache, v_cache, tables, lens)`: one program per (sequence, kv head) reads
that head's K/V once, block by block through the sequence's block table, for all
`H_q / H_kv` query heads it serves (GQA), with an online softmax. K/V and q are read in
their own dtype (the model's), products and sums are float32, the result is float32.
Only the first `ceil(len / bs)` table entries of a row are read, so a static decode step's
padded table width costs nothing. Tested against `naive.attention_naive` on the CPU with
`TRITON_INTERPRET=1` (tests/test_kernels_attention_triton.py). No split over the context:
one program walks a whole sequence (long contexts at small batch leave SMs idle).
"""
from __future__ import annotations

import os
from typing import ClassVar

import torch
import triton
import triton.language as tl

from vlbatch.operators.errors import SetupError
from vlbatch.operators.kernels.attention.layout import PagedLayout
from vlbatch.operators.kernels.attention.torch_sdpa import SdpaPagedAttention


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, out_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
                         D: tl.constexpr, BS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    length = tl.load(len_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    gmask, dmask = offs_g < GROUP, offs_d < D
    heads = kvh * GROUP + offs_g  # [G] query heads of this kv head
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [G, D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in range(0, tl.cdiv(length, BS)):
        blk = tl.load(tab_ptr + b * stride_tb + i).to(tl.int64)
        nmask = (offs_n < BS) & (i * BS + offs_n < length)
        kv_off = blk * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kvmask, other=0.0).to(tl.float32)  # [N, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + kv_off, mask=kvmask, other=0.0).to(tl.float32)  # [N, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out,
             mask=gmask[:, None] & dmask[None, :])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
    """q [B, H_q, D]; k_cache / v_cache [num_blocks, bs, H_kv, D]; tables [B, W] int32 block
    tables; lens [B] int32 context lengths (>= 1, the new token included, its K/V already
    stored) -> out [B, H_q, D] float32: each query over positions 0..len-1 of its sequence."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    if b == 0:
        return out
    group = hq // hkv
    _paged_decode_kernel[(b, hkv)](
        q, k_cache, v_cache, tables, lens, out, d**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        D=d, BS=bs, GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=triton.next_power_of_2(bs),
        BLOCK_D=triton.next_power_of_2(d))
    return out


class TritonPagedAttention(SdpaPagedAttention):
    """`base.PagedAttention` with decode rows by `paged_decode` (CUDA, or the CPU under
    `TRITON_INTERPRET=1`); everything else as `SdpaPagedAttention`."""

    name: ClassVar[str] = "triton"

    @classmethod
    def create(cls, device) -> TritonPagedAttention:
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SetupError(f"model.engine.attention=triton is a CUDA kernel but the engine runs on {device!r} "
                             "(use auto, or a GPU); TRITON_INTERPRET=1 runs it on the CPU for tests")
        return cls()

    def decode(self, layout: PagedLayout, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        bs = layout.block_size
        shape = (-1, bs, kc.shape[1], kc.shape[2])
        return paged_decode(q, kc.view(shape), vc.view(shape), layout.decode_tables, layout.decode_lens)
