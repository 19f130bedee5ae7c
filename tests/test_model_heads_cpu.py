"""The compiled DeltaNet q / k heads (operators/model/ops/heads_cpu.py) against their torch twin
at odd shapes (strided rows, H_v = H_k and H_v = r * H_k), and the attention q / k norm + MRoPE (ops/rope_cpu.py)."""
from __future__ import annotations

import pytest
import torch

from vlbatch.operators.model.layers import rms_norm_torch
from vlbatch.operators.model.ops import heads_cpu, rope_cpu


@pytest.mark.parametrize("t,n_k,n_v,d_k", [(1, 1, 1, 1), (3, 2, 2, 7), (5, 3, 6, 13), (17, 4, 8, 64), (2, 1, 3, 5)])
def test_qk_heads_match_the_torch_twin(t, n_k, n_v, d_k):
    torch.manual_seed(t * 31 + d_k)
    extra = 9  # v and more after q | k: the kernel reads rows with a stride > 2 * H_k * D_k
    mixed = torch.randn(t, 2 * n_k * d_k + extra) * 3
    qk = mixed[:, : 2 * n_k * d_k]
    assert heads_cpu.usable(qk) and qk.stride(0) == mixed.shape[1]
    scale = d_k ** -0.5
    q, k = heads_cpu.qk_heads_cpu(qk, n_k, n_v, d_k, scale)
    q_ref, k_ref = heads_cpu.qk_heads_torch(qk, n_k, n_v, d_k, scale)
    assert q.shape == k.shape == (t, n_v, d_k)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-5)
    # the twin itself: L2-normalised rows, key head i serving value heads i*r .. i*r + r - 1
    r = n_v // n_k
    heads = qk.reshape(t, 2, n_k, d_k)
    for h in range(n_v):
        src = heads[:, 1, h // r]
        torch.testing.assert_close(k_ref[:, h], src / (src.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt())


def test_a_zero_row_stays_finite():
    qk = torch.zeros(2, 2 * 2 * 4)
    q, k = heads_cpu.qk_heads_cpu(qk, 2, 4, 4, 0.5)
    assert torch.equal(q, torch.zeros_like(q)) and torch.equal(k, torch.zeros_like(k))


def test_other_dtypes_take_the_torch_form():
    qk = torch.randn(3, 16).bfloat16()
    assert not heads_cpu.usable(qk)
    q, k = heads_cpu.qk_heads_torch(qk, 2, 2, 4, 0.5)
    assert q.dtype == k.dtype == torch.float32


@pytest.mark.parametrize("t,h,d,r", [(1, 1, 2, 2), (3, 2, 7, 4), (5, 3, 64, 16), (9, 8, 64, 64), (2, 2, 10, 6)])
def test_norm_rope_matches_the_torch_twin(t, h, d, r):
    """q of the attention layer is a strided chunk of [T, H, 2 D]; k a contiguous view."""
    torch.manual_seed(t + d)
    wide = torch.randn(t, h, 2 * d) * 2
    x = wide.chunk(2, dim=-1)[0]
    w = torch.randn(d) * 0.3
    ang = torch.randn(t, r // 2) * 5
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    assert rope_cpu.usable(x, w, cos, sin)
    out = rope_cpu.norm_rope_cpu(x, w, 1e-6, cos, sin)
    torch.testing.assert_close(out, rope_cpu.norm_rope_torch(x, w, 1e-6, cos, sin), atol=2e-6, rtol=1e-5)
    if r < d:  # dims past R pass through the rotation: the norm alone
        torch.testing.assert_close(out[..., r:], rms_norm_torch(x, w, 1e-6)[..., r:], atol=1e-6, rtol=1e-5)
