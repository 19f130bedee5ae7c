"""The compiled CPU norms (operators/model/ops/norm_cpu.py) against their torch twins at odd
shapes, strided inputs included, and the layers' dispatch."""
from __future__ import annotations

import pytest
import torch

from vlbatch.operators.model.layers import GatedRMSNorm, RMSNorm, gated_rms_norm_torch, rms_norm_torch
from vlbatch.operators.model.ops import norm_cpu


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 2, 13), (17, 512), (4, 3, 5, 64)])
def test_rms_norm_matches_torch(shape):
    torch.manual_seed(len(shape))
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1])
    out = norm_cpu.rms_norm_cpu(x, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_torch(x, w, 1e-6), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(RMSNorm(shape[-1], 1e-6).requires_grad_(False).forward(x),
                               rms_norm_torch(x, torch.zeros(shape[-1]), 1e-6), atol=1e-6, rtol=1e-5)


def test_rms_norm_reads_strided_rows():
    """q of the attention layer is a chunk of a wider tensor: rows with a stride > D."""
    torch.manual_seed(1)
    wide, w = torch.randn(6, 3, 22), torch.randn(11)
    x = wide.chunk(2, dim=-1)[0]
    assert not x.is_contiguous()
    torch.testing.assert_close(norm_cpu.rms_norm_cpu(x, w, 1e-5), rms_norm_torch(x, w, 1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 3, 5), (9, 8, 64)])
def test_gated_rms_norm_matches_torch(shape):
    torch.manual_seed(shape[0])
    x, z, w = torch.randn(*shape), torch.randn(*shape) * 4, torch.rand(shape[-1]) + 0.5
    out = norm_cpu.gated_rms_norm_cpu(x, z, w, 1e-6)
    torch.testing.assert_close(out, gated_rms_norm_torch(x, z, w, 1e-6), atol=1e-6, rtol=1e-5)
    norm = GatedRMSNorm(shape[-1], 1e-6).requires_grad_(False)
    norm.weight.copy_(w)
    torch.testing.assert_close(norm(x, z), gated_rms_norm_torch(x, z, w, 1e-6), atol=1e-6, rtol=1e-5)


def test_gated_rms_norm_reads_the_gate_as_a_view():
    """DeltaNet's gate z is a column slice of the fused projection's output (rows with a stride
    > D), and x the rule's contiguous output; the gate's SiLU is what the kernel overwrites."""
    torch.manual_seed(2)
    x, wide, w = torch.randn(5, 4, 16), torch.randn(5, 96) * 3, torch.rand(16) + 0.5
    z = wide[:, 32:].view(5, 4, 16)
    assert not z.is_contiguous()
    before = wide.clone()
    out = norm_cpu.gated_rms_norm_cpu(x, z, w, 1e-6)
    torch.testing.assert_close(out, gated_rms_norm_torch(x, z, w, 1e-6), atol=1e-6, rtol=1e-5)
    assert torch.equal(wide, before)  # the inputs are left as they were


def test_other_dtypes_take_the_torch_form():
    x = torch.randn(4, 16).bfloat16()
    norm = RMSNorm(16, 1e-6).bfloat16()
    assert not norm_cpu.usable(x, norm.weight)
    assert torch.equal(norm(x), rms_norm_torch(x, norm.weight, 1e-6))
