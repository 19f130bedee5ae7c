"""Paged attention (operators/kernels/attention): the SDPA implementation against the naive
reference over odd shapes, and the contract of every implementation."""
from __future__ import annotations

import random

import pytest
import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels.attention import select_attention
from vlbatch.operators.kernels.attention.layout import PagedLayout
from vlbatch.operators.kernels.attention.naive import NaivePagedAttention, attention_naive
from vlbatch.operators.kernels.attention.torch_sdpa import SdpaPagedAttention


def _paged_case(rng, lens, block_size, n_blocks, hq, hkv, d):
    """Random caches, block tables with shuffled blocks, one chunk per sequence."""
    blocks = list(range(n_blocks))
    rng.shuffle(blocks)
    tables, starts, ends, _hist_k, _hist_v = [], [], [], [], []
    kc = torch.randn(n_blocks, block_size, hkv, d)
    vc = torch.randn(n_blocks, block_size, hkv, d)
    for past, new in lens:
        need = -(-(past + new) // block_size)
        tables.append([blocks.pop() for _ in range(need)])
        starts.append(past)
        ends.append(past + new)
    return tables, starts, ends, kc, vc


@pytest.mark.parametrize("block_size,hq,hkv,d", [(4, 4, 2, 8), (3, 6, 3, 5), (16, 2, 2, 7)])
def test_paged_attention_matches_naive_on_odd_shapes(block_size, hq, hkv, d):
    rng = random.Random(block_size)
    lens = [(0, 7), (5, 1), (13, 1), (9, 4), (0, 1), (2, 11)]  # (cached, new): prefills and decodes mixed
    tables, starts, ends, kc, vc = _paged_case(rng, lens, block_size, 64, hq, hkv, d)
    t = sum(e - s for s, e in zip(starts, ends, strict=False))
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    layout = PagedLayout.build(tables, starts, ends, block_size, "cpu")
    out = SdpaPagedAttention()(layout, kc, vc, q, k, v)
    row = 0
    for table, s, e in zip(tables, starts, ends, strict=False):
        pos = torch.arange(e)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k_all, v_all = kc.view(-1, hkv, d)[slots], vc.view(-1, hkv, d)[slots]
        assert torch.equal(k_all[s:], k[row: row + e - s])  # new K/V were written at their slots
        ref = attention_naive(q[row: row + e - s], k_all, v_all)
        torch.testing.assert_close(out[row: row + e - s].double(), ref, atol=1e-5, rtol=1e-5)
        row += e - s


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_rows_equal_the_full_rows(block_size):
    """With `rows`, queries of those rows only (any mix of decode and prefill chunks) give
    the same outputs as the full call, and all new K/V are still stored."""
    rng = random.Random(block_size)
    lens = [(0, 7), (5, 1), (13, 1), (9, 4), (0, 1), (2, 11)]
    tables, starts, ends, kc, vc = _paged_case(rng, lens, block_size, 64, 4, 2, 8)
    t = sum(e - s for s, e in zip(starts, ends, strict=False))
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    layout = PagedLayout.build(tables, starts, ends, block_size, "cpu")
    attend = SdpaPagedAttention()
    full = attend(layout, kc.clone(), vc.clone(), q, k, v)
    rows = torch.tensor([0, 6, 8, 9, 12, 14, 20])  # chunk ends, a chunk's middle row, its first row
    kc2, vc2 = kc.clone(), vc.clone()
    part = attend(layout, kc2, vc2, q[rows], k, v, rows)
    torch.testing.assert_close(part, full[rows], atol=1e-6, rtol=1e-5)
    assert torch.equal(kc2.view(-1, 2, 8)[layout.slot_mapping], k)


@pytest.mark.parametrize("impl", [SdpaPagedAttention, NaivePagedAttention])
@pytest.mark.parametrize("lens", [[(0, 1)], [(6, 1), (0, 9), (3, 1)], [(0, 5), (5, 5)]])
def test_contract(impl, lens):
    """`base.PagedAttention`: the caches are written in place at `slot_mapping` (nothing
    else changes), out is float32 [T, H_q, D] even for bfloat16 caches, and `rows` gives
    those rows of the full result; both implementations agree."""
    rng = random.Random(len(lens))
    tables, starts, ends, kc, vc = _paged_case(rng, lens, 4, 16, 6, 2, 8)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    t = sum(e - s for s, e in zip(starts, ends, strict=True))
    q, k, v = torch.randn(t, 6, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    layout = PagedLayout.build(tables, starts, ends, 4, "cpu")
    kc2, vc2 = kc.clone(), vc.clone()
    out = impl()(layout, kc2, vc2, q, k, v)
    assert out.dtype == torch.float32 and out.shape == (t, 6, 8)
    written = torch.zeros(kc.numel() // 16, dtype=torch.bool)
    written[layout.slot_mapping] = True
    assert torch.equal(kc2.view(-1, 2, 8)[layout.slot_mapping], k.bfloat16())
    assert torch.equal(kc2.view(-1, 2, 8)[~written], kc.view(-1, 2, 8)[~written])
    assert torch.equal(vc2.view(-1, 2, 8)[layout.slot_mapping], v.bfloat16())
    ref = NaivePagedAttention()(layout, kc.clone(), vc.clone(), q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([t - 1] if t == 1 else [0, t - 1])
    part = impl()(layout, kc.clone(), vc.clone(), q[rows], k, v, rows)
    torch.testing.assert_close(part, ref[rows], atol=1e-5, rtol=1e-5)


def test_selection():
    a, b = select_attention(), select_attention()
    assert isinstance(a, SdpaPagedAttention) and a.workspace is not b.workspace  # one per engine
    assert isinstance(select_attention("naive"), NaivePagedAttention)
    with pytest.raises(ConfigError, match="model.engine.attention: unknown attention kernel .flash.; allowed: auto, sdpa, cpu, triton, naive"):
        select_attention("flash")
