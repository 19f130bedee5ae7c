"""MoE routed experts (operators/kernels/moe): the grouped and padded implementations
against the per-expert loop over odd shapes, and the choice made at load."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels.moe import select_experts
from vlbatch.operators.kernels.moe.grouped import GroupedMMExperts
from vlbatch.operators.kernels.moe.naive import LoopExperts
from vlbatch.operators.kernels.moe.padded import PaddedExperts


def _case(t, k, e, d, inner, seed, dtype=torch.float32, skip=()):
    """Random x [T, D], routing [T, k] (distinct experts per token, none of `skip`), weights."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(e) if i not in skip])
    scores = torch.rand(t, len(allowed), generator=gen)
    index = allowed[scores.topk(k, dim=-1).indices]
    weight = torch.rand(t, k, generator=gen)
    weight = weight / weight.sum(-1, keepdim=True)
    x = torch.randn(t, d, generator=gen)
    gate_up = torch.randn(e, 2 * inner, d, generator=gen) * d**-0.5
    down = torch.randn(e, d, inner, generator=gen) * inner**-0.5
    return [a.to(dtype) for a in (x, index.float(), weight, gate_up, down)]


# (T, k, E, D, I, experts given no token); D and I multiples of 4: grouped_mm's 16-byte strides
SHAPES = [(1, 1, 4, 8, 4, ()), (1, 3, 8, 16, 12, ()), (5, 2, 8, 8, 4, (0, 3, 7)), (37, 4, 6, 24, 20, (2,)),
          (64, 8, 16, 32, 8, ())]


@pytest.mark.parametrize("impl", [GroupedMMExperts(), PaddedExperts()], ids=lambda i: i.name)
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_the_loop(impl, shape):
    *dims, skip = shape
    x, index, weight, gate_up, down = _case(*dims, seed=sum(dims), skip=skip)
    index = index.long()
    before = [a.clone() for a in (x, index, weight, gate_up, down)]
    ref = LoopExperts()(x, index, weight, gate_up, down, F.silu)
    out = impl(x, index, weight, gate_up, down, F.silu)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out - ref).abs().max() < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(before, (x, index, weight, gate_up, down), strict=True))
    assert ref.abs().max() > 1e-2  # the case really routes something


def test_loop_is_the_definition():
    """The reference itself against the formula, token by token."""
    x, index, weight, gate_up, down = _case(7, 3, 5, 6, 5, seed=3, skip=(1,))
    index = index.long()
    out = LoopExperts()(x, index, weight, gate_up, down, F.silu)
    for t in range(7):
        want = torch.zeros(6)
        for j in range(3):
            e = int(index[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want += weight[t, j] * (down[e] @ (F.silu(gate) * up))
        assert (out[t] - want).abs().max() < 1e-5


@pytest.mark.parametrize("shape", [(3, 2, 5, 6, 5, (4,)), (1, 2, 3, 10, 3, ())])
def test_padded_takes_unaligned_dims(shape):
    *dims, skip = shape
    x, index, weight, gate_up, down = _case(*dims, seed=1, skip=skip)
    index = index.long()
    ref = LoopExperts()(x, index, weight, gate_up, down, F.silu)
    assert (PaddedExperts()(x, index, weight, gate_up, down, F.silu) - ref).abs().max() < 1e-5


def test_bfloat16_stays_close_to_the_fp32_loop():
    x, index, weight, gate_up, down = _case(9, 2, 8, 16, 8, seed=4)
    ref = LoopExperts()(x, index.long(), weight, gate_up, down, F.silu)
    low = [a.bfloat16() for a in (x, weight, gate_up, down)]
    for impl in (GroupedMMExperts(), PaddedExperts()):
        out = impl(low[0], index.long(), low[1], low[2], low[3], F.silu)
        assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 3e-2


def test_selection():
    assert select_experts("cpu", torch.float32, 64, 32) == GroupedMMExperts()
    assert select_experts("cpu", torch.float32, 6, 5) == PaddedExperts()  # 24- / 20-byte rows
    assert select_experts("cpu", torch.bfloat16, 64, 32, "loop") == LoopExperts()
    assert select_experts("cpu", torch.float32, 64, 32, "padded") == PaddedExperts()
    with pytest.raises(ConfigError, match="does not take"):
        select_experts("cpu", torch.float32, 6, 5, "grouped_mm")
    with pytest.raises(ConfigError, match="model.engine.moe: unknown .*allowed: auto, grouped_mm, padded, loop"):
        select_experts("cpu", torch.float32, 64, 32, "triton")


def test_load_model_stores_the_chosen_kernel_on_every_moe_layer(tiny_ckpt):
    from vlbatch.operators.model import load_model
    from vlbatch.operators.model.moe import Experts

    model = load_model(tiny_ckpt("moe"))
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(m.kernel == GroupedMMExperts() for m in experts)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    grouped = model(ids)
    model.use_experts(LoopExperts())
    assert all(m.kernel == LoopExperts() for m in experts)
    assert (model(ids) - grouped).abs().max() < 1e-5
