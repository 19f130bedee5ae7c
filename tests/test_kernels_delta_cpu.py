"""The CPU fast paths of the torch delta rule against their naive twins, over odd shapes, in
float32 within 1e-5: the compiled decode step (`cpu_decode.py`) and the blocked unit
lower-triangular inverse of the packed prefill (`packed.unit_lower_inverse`); and the
benchmark's phase timer (`benchmarks/phases.py`) leaves an engine's outputs alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlbatch.operators.kernels.delta_rule import cpu_decode, cpu_scan
from vlbatch.operators.kernels.delta_rule.chunked import recurrent_gated_delta_rule_
from vlbatch.operators.kernels.delta_rule.naive import NaiveDeltaRule
from vlbatch.operators.kernels.delta_rule.packed import (
    chunk_gated_delta_rule_packed,
    unit_lower_inverse,
    unit_lower_inverse_naive,
)
from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule

TOL = 1e-5


def _tokens(t, h, dk, dv, seed, decay=0.5):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * decay
    beta = torch.rand(t, h, generator=gen)
    return q, k, v, g, beta, gen


@pytest.mark.parametrize("shape", [(5, 3, 7, 5), (1, 1, 64, 64), (64, 8, 16, 4), (3, 2, 128, 33)])
def test_compiled_decode_equals_naive_and_writes_the_state_in_place(shape):
    b, h, dk, dv = shape
    q, k, v, g, beta, gen = _tokens(b, h, dk, dv, seed=b * h + dk)
    state = torch.randn(b, h, dk, dv, generator=gen)
    ref_state = state.clone()
    o_ref = NaiveDeltaRule().decode_(q, k, v, g, beta, ref_state)
    ptr = state.data_ptr()
    o = cpu_decode.decode_step_cpu_(q, k, v, g, beta, state)
    assert state.data_ptr() == ptr and o.shape == (b, h, dv) and o.dtype == torch.float32
    assert (o - o_ref).abs().max() < TOL and (state - ref_state).abs().max() < TOL


@pytest.mark.parametrize("shape,slots", [((5, 3, 7, 5), [4, 0, 7, 2, 5]), ((1, 1, 64, 64), [3]),
                                         ((6, 8, 16, 4), [9, 1, 2, 8, 0, 5])])
@pytest.mark.parametrize("kernels", [TorchDeltaRule(), NaiveDeltaRule()], ids=["compiled", "default"])
def test_decode_by_slot_updates_the_pool_in_place_and_leaves_other_slots(shape, slots, kernels):
    """`decode_slots_`: the compiled step indexing the pool (TorchDeltaRule on CPU) and the
    contract's default (gather, decode_, store back: NaiveDeltaRule) equal the naive step on
    the gathered states; slots not in the step are untouched."""
    b, h, dk, dv = shape
    q, k, v, g, beta, gen = _tokens(b, h, dk, dv, seed=b + dk)
    pool = torch.randn(max(slots) + 2, h, dk, dv, generator=gen)
    idx = torch.tensor(slots)
    ref_state = pool[idx].clone()
    o_ref = NaiveDeltaRule().decode_(q, k, v, g, beta, ref_state)
    before = pool.clone()
    o = kernels.decode_slots_(q, k, v, g, beta, pool, idx)
    torch.testing.assert_close(o, o_ref, atol=TOL, rtol=0)
    torch.testing.assert_close(pool[idx], ref_state, atol=TOL, rtol=0)
    others = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[others], before[others])


def test_compiled_decode_equals_the_torch_step_on_strided_inputs_and_bf16_values():
    """Inputs as the layer hands them (k a strided view of a wider tensor, v in bf16)."""
    q, k, v, g, beta, gen = _tokens(6, 4, 16, 8, seed=3)
    k = torch.cat([k, k], dim=-1)[..., :16]  # non-contiguous
    v = v.to(torch.bfloat16)
    state = torch.randn(6, 4, 16, 8, generator=gen)
    twin = state.clone()
    o = cpu_decode.decode_step_cpu_(q, k, v, g, beta, state)
    o_twin = recurrent_gated_delta_rule_(q, k, v, g, beta, twin)
    assert o.dtype == torch.bfloat16 and (o.float() - o_twin.float()).abs().max() < 2e-2
    assert (state - twin).abs().max() < TOL


@pytest.mark.parametrize("lens", [(1, 1, 1), (5, 1, 9)])
def test_compiled_scan_reads_v_as_a_column_view_bit_for_bit(lens):
    """The layer's v is a column view of the conv output [T, C] (rows C apart): the kernel
    reads it in place, with the same numbers as from a contiguous copy, in the packed
    prefill and in the decode step (one token per sequence)."""
    t, (h, dk, dv) = sum(lens), (3, 16, 8)
    q, k, v, g, beta, gen = _tokens(t, h, dk, dv, seed=t)
    wide = torch.cat([torch.randn(t, 2 * h * dk, generator=gen), v.reshape(t, h * dv)], dim=-1)
    view = wide[:, 2 * h * dk:].reshape(t, h, dv)
    assert not view.is_contiguous() and torch.equal(view, v)
    state = torch.randn(len(lens), h, dk, dv, generator=gen)
    o_view, s_view = cpu_scan.prefill_scan_cpu(q, k, view, g, beta, state, lens)
    o_copy, s_copy = cpu_scan.prefill_scan_cpu(q, k, v, g, beta, state, lens)
    assert torch.equal(o_view, o_copy) and torch.equal(s_view, s_copy)
    o_ref, s_ref = NaiveDeltaRule().prefill(q, k, v, g, beta, state, lens)
    assert (o_view - o_ref).abs().max() < TOL and (s_view - s_ref).abs().max() < TOL
    if max(lens) == 1:
        pool = state.clone()
        assert torch.equal(cpu_decode.decode_step_cpu_(q, k, view, g, beta, pool), o_copy)
        assert torch.equal(pool, s_copy)


def test_torch_kernels_use_the_compiled_step_only_where_it_applies():
    q, k, v, g, beta, gen = _tokens(4, 2, 8, 8, seed=5)
    pool = torch.randn(4, 2, 8, 16, generator=gen)
    strided = pool[..., :8]  # a state view the compiled step cannot write through numpy
    assert cpu_decode.usable(pool[:2]) and not cpu_decode.usable(strided)
    assert not cpu_decode.usable(pool.double())
    ref = strided.clone()
    o_ref = NaiveDeltaRule().decode_(q, k, v, g, beta, ref)
    o = TorchDeltaRule().decode_(q, k, v, g, beta, strided)  # falls back to the torch step, in place
    assert (o - o_ref).abs().max() < TOL and (pool[..., :8] - ref).abs().max() < TOL


@pytest.mark.parametrize("c", [1, 5, 16, 32, 48, 64, 128])
@pytest.mark.parametrize("batch", [(3,), (2, 5)])
def test_blocked_unit_lower_inverse_equals_the_solve(c, batch):
    gen = torch.Generator().manual_seed(c)
    strict = torch.randn(*batch, c, c, generator=gen) * c**-0.5  # the scale of beta (K K^T * R), unit k
    strict.add_(torch.triu(torch.full((c, c), 7.0), 0))  # garbage on and above the diagonal: never read
    exact = unit_lower_inverse_naive(strict.double())
    inv = unit_lower_inverse(strict)
    assert inv.shape == strict.shape and inv.dtype == torch.float32
    assert (inv.double() - exact).abs().max() < TOL
    assert torch.equal(inv.triu(1), torch.zeros_like(inv))
    eye = torch.eye(c, dtype=torch.float64)
    assert (inv.double() @ (strict.double().tril(-1) + eye) - eye).abs().max() < TOL


@pytest.mark.parametrize("lens", [(5, 130, 64, 65, 1, 200, 3), (64, 128), (129,)])
@pytest.mark.parametrize("dims", [(3, 16, 8), (2, 64, 64)])
def test_packed_prefill_equals_naive_within_1e5(lens, dims):
    h, dk, dv = dims
    q, k, v, g, beta, gen = _tokens(sum(lens), h, dk, dv, seed=sum(lens) + dk, decay=1.5)
    state = torch.randn(len(lens), h, dk, dv, generator=gen) * 0.3
    o, s = chunk_gated_delta_rule_packed(q, k, v, g, beta, state, lens, 64)
    o_ref, s_ref = NaiveDeltaRule().prefill(q, k, v, g, beta, state, lens)
    assert (o - o_ref).abs().max() < TOL and (s - s_ref).abs().max() < TOL
