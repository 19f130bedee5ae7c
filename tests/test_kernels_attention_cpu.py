"""The numba paged-decode kernel (operators/kernels/attention/cpu_decode.py) against the naive
reference at odd shapes: odd head counts, GQA, block sizes, contexts not a multiple of the block."""
from __future__ import annotations

import random

import pytest
import torch

from vlbatch.operators.kernels.attention import select_attention
from vlbatch.operators.kernels.attention.cpu_decode import CpuPagedAttention, paged_decode_cpu
from vlbatch.operators.kernels.attention.layout import PagedLayout
from vlbatch.operators.kernels.attention.naive import NaivePagedAttention

CASES = [  # block_size, H_q, H_kv, D, (cached, new) per sequence
    (4, 4, 2, 8, [(5, 1), (13, 1), (0, 1), (2, 1)]),
    (3, 6, 3, 5, [(7, 1), (0, 1), (10, 1)]),
    (16, 3, 1, 7, [(20, 1), (33, 1)]),
    (5, 9, 3, 13, [(0, 6), (11, 1), (4, 1), (2, 9), (29, 1)]),  # prefills mixed in
]


@pytest.mark.parametrize("bs,hq,hkv,d,lens", CASES)
def test_cpu_paged_decode_matches_naive(bs, hq, hkv, d, lens):
    torch.manual_seed(bs)
    rng = random.Random(bs)
    blocks = list(range(64))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-(p + n) // bs) + 1)] for p, n in lens]  # one spare block each
    starts, ends = [p for p, _ in lens], [p + n for p, n in lens]
    kc, vc = torch.randn(64, bs, hkv, d), torch.randn(64, bs, hkv, d)
    t = sum(n for _, n in lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    layout = PagedLayout.build(tables, starts, ends, bs, "cpu")
    ref = NaivePagedAttention()(layout, kc.clone(), vc.clone(), q, k, v)
    kc2, vc2 = kc.clone(), vc.clone()
    out = CpuPagedAttention()(layout, kc2, vc2, q, k, v)
    assert out.dtype == torch.float32 and out.shape == (t, hq, d)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc2.view(-1, hkv, d)[layout.slot_mapping], k)
    assert "decode_context" not in layout.__dict__  # the tables were read: no flat context was made
    # the kernel alone over a table wider than needed (a static step's padding) and a padded row
    nd = len(layout.decode_rows)
    wide = torch.zeros(nd + 1, 16, dtype=torch.int32)
    wide[:nd, : layout.decode_tables.shape[1]] = layout.decode_tables
    lens_w = torch.cat([layout.decode_lens, torch.ones(1, dtype=torch.int32)])
    qw = torch.cat([q[layout.decode_rows], torch.zeros(1, hq, d)])
    direct = paged_decode_cpu(qw, kc2, vc2, wide, lens_w)
    torch.testing.assert_close(direct[:nd], ref[layout.decode_rows], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(direct[nd]).all()


def test_bfloat16_caches_take_the_gather_path():
    bs, hq, hkv, d, lens = CASES[0]
    tables = [[i * 5 + j for j in range(5)] for i in range(len(lens))]
    kc, vc = torch.randn(32, bs, hkv, d).bfloat16(), torch.randn(32, bs, hkv, d).bfloat16()
    t = len(lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    layout = PagedLayout.build(tables, [p for p, _ in lens], [p + n for p, n in lens], bs, "cpu")
    ref = NaivePagedAttention()(layout, kc.clone(), vc.clone(), q, k, v)
    out = CpuPagedAttention()(layout, kc, vc, q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert "decode_context" in layout.__dict__  # made on demand, from the tables, for the gather


def test_auto_selects_the_cpu_kernel_on_the_cpu_only():
    assert isinstance(select_attention("auto", "cpu"), CpuPagedAttention)
    meta = select_attention("auto", "meta")
    assert not isinstance(meta, CpuPagedAttention) and meta.name == "sdpa"


@pytest.mark.slow
@pytest.mark.parametrize("n,scale", [(1, 1.0), (7, 3.0), (33, 40.0), (513, 0.01), (1000, 200.0)])
def test_softmax_exp_matches_exp(n, scale):
    """The vectorised exp (cpu_decode.softmax_exp_) against float64 exp and its libm twin, odd
    lengths (the vector loop's remainder) and score spreads far past exp's float32 range."""
    import numpy as np

    from vlbatch.operators.kernels.attention.cpu_decode import _exp_twin, softmax_exp_

    rng = np.random.default_rng(n)
    s = (rng.standard_normal(n + 3) * scale).astype(np.float32)  # 3 past n: must stay untouched
    fast, twin, bits = s.copy(), s.copy(), np.empty(n, np.int32)
    total = softmax_exp_(fast, n, bits)
    twin_total = _exp_twin(twin, n, bits)
    x = s[:n].astype(np.float32) - s[:n].max()  # the same float32 subtraction
    ref = np.exp(x.astype(np.float64))
    seen = x >= -87.0  # below, the fast form gives exp(-87) (see the module)
    assert np.all(np.abs(fast[:n] - ref)[seen] <= 3e-7 * ref[seen])
    np.testing.assert_allclose(fast[:n][~seen], np.exp(-87.0), rtol=3e-7)
    assert np.array_equal(fast[n:], s[n:])
    np.testing.assert_allclose(total, twin_total, rtol=1e-6)
    np.testing.assert_allclose(fast[:n], twin[:n], rtol=6e-7, atol=2e-38)


def test_softmax_exp_sweep():
    """Every 1/1000 of [-87, 0]: within 3e-7 of float64 exp (Cephes' bound, with margin)."""
    import numpy as np

    from vlbatch.operators.kernels.attention.cpu_decode import softmax_exp_

    x = np.linspace(-87.0, 0.0, 87_001).astype(np.float32)
    out = x.copy()
    softmax_exp_(out, len(x), np.empty(len(x), np.int32))
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) <= 3e-7
