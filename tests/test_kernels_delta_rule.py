"""The gated delta rule's torch kernels (operators/kernels/delta_rule) against the naive
reference, over odd lengths and non-zero states, and the contract of every implementation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlbatch.operators.kernels.delta_rule.chunked import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_,
)
from vlbatch.operators.kernels.delta_rule.naive import NaiveDeltaRule, delta_rule_naive
from vlbatch.operators.kernels.delta_rule.packed import chunk_gated_delta_rule_packed
from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule

TOL = 2e-5


def _inputs(b, t, h, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    logdecay = -torch.rand(b, t, h, generator=g) * 0.5  # some strong, some weak forgetting
    beta = torch.rand(b, t, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    return q, k, v, logdecay, beta, state


def _naive(q, k, v, logdecay, beta, state):
    tr = lambda x: x.transpose(1, 2)  # noqa: E731  [B, T, H, *] <-> [B, H, T, *]
    o, s = delta_rule_naive(tr(q), tr(k), tr(v), tr(logdecay).exp(), tr(beta), state)
    return tr(o), s


def test_naive_reference_reproduces_the_seed_hand_example():
    """Seed 000 section 9.8: two steps on a 2x2 state, worked out by hand."""
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0]]).view(1, 1, 2, 2)
    v = torch.tensor([[2.0, 0.0], [0.0, 4.0]]).view(1, 1, 2, 2)
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]]).view(1, 1, 2, 2) / 2**0.5
    alpha = torch.tensor([1.0, 0.5]).view(1, 1, 2)
    beta = torch.tensor([1.0, 0.5]).view(1, 1, 2)
    o, s = delta_rule_naive(q, k, v, alpha, beta)
    assert torch.allclose(s[0, 0], torch.tensor([[0.5, 2.0], [0.0, 0.0]]))
    assert torch.allclose(o[0, 0, 1], torch.tensor([0.353553, 1.414214]), atol=1e-6)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 4, 8, 12)])
def test_chunked_equals_naive(length, shape):
    b, h, dk, dv = shape
    q, k, v, g, beta, s0 = _inputs(b, length, h, dk, dv, seed=length)
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert o.shape == (b, length, h, dv) and s.shape == (b, h, dk, dv)
    assert (o - o_ref).abs().max() < TOL
    assert (s - s_ref).abs().max() < TOL


@pytest.mark.parametrize("length", [1, 5])
def test_recurrent_equals_naive(length):
    q, k, v, g, beta, s0 = _inputs(3, length, 4, 16, 8, seed=7)
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o - o_ref).abs().max() < TOL and (s - s_ref).abs().max() < TOL


def test_chunked_continuation_equals_one_pass():
    q, k, v, g, beta, s0 = _inputs(2, 200, 3, 16, 16, seed=11)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    state, outs = s0, []
    for lo, hi in [(0, 65), (65, 66), (66, 129), (129, 200)]:  # odd splits, one a single token
        rule = recurrent_gated_delta_rule if hi - lo == 1 else chunk_gated_delta_rule
        o, state = rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state)
        outs.append(o)
    assert (torch.cat(outs, dim=1) - o_all).abs().max() < TOL
    assert (state - s_all).abs().max() < TOL


def test_chunked_without_initial_state_is_zero_state():
    q, k, v, g, beta, s0 = _inputs(1, 70, 2, 8, 8, seed=3)
    o1, s1 = chunk_gated_delta_rule(q, k, v, g, beta)
    o2, s2 = chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(s0))
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    o3, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o3 - o1).abs().max() > 1e-3  # the initial state is really read


@pytest.mark.parametrize("shape", [(5, 3, 7, 5), (1, 1, 64, 64), (64, 8, 16, 4)])
def test_recurrent_odd_shapes_and_input_state_left_intact(shape):
    b, h, dk, dv = shape
    q, k, v, g, beta, s0 = _inputs(b, 3, h, dk, dv, seed=b * h)
    keep = s0.clone()
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o - o_ref).abs().max() < TOL and (s - s_ref).abs().max() < TOL
    assert torch.equal(s0, keep)  # the caller's state (a pool view) is never written


@pytest.mark.parametrize("lens", [(5, 130, 64, 65, 1, 200, 3), (2, 2), (33,)])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_packed_chunked_equals_naive_per_sequence(lens, chunk):
    q, k, v, g, beta, _ = _inputs(1, sum(lens), 3, 16, 8, seed=len(lens) + chunk)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))  # packed [T, H, *]
    s0 = torch.randn(len(lens), 3, 16, 8, generator=torch.Generator().manual_seed(chunk))
    keep = s0.clone()
    o, s = chunk_gated_delta_rule_packed(q, k, v, g, beta, s0, lens, chunk)
    assert torch.equal(s0, keep)  # the caller's states are read, never written
    start = 0
    for i, n in enumerate(lens):
        rows = slice(start, start + n)
        o_ref, s_ref = _naive(q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows], s0[i: i + 1])
        assert (o[rows] - o_ref[0]).abs().max() < TOL, f"sequence {i} ({n} tokens)"
        assert (s[i] - s_ref[0]).abs().max() < TOL
        start += n


def test_packed_chunked_strong_decay_stays_exact():
    """Decay factors far below exp(EXP_FLOOR) (clamped there) still give the naive result."""
    q, k, v, g, beta, s0 = _inputs(1, 70, 2, 8, 8, seed=9)
    g = g * 60  # log decays down to -30 per token: products of many fall below 1e-35
    o, s = chunk_gated_delta_rule_packed(q[0], k[0], v[0], g[0], beta[0], s0, (70,), 64)
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    assert (o - o_ref[0]).abs().max() < TOL and (s - s_ref).abs().max() < TOL


@pytest.mark.parametrize("shape", [(5, 3, 7, 5), (64, 8, 16, 4)])
def test_recurrent_in_place_equals_naive(shape):
    b, h, dk, dv = shape
    q, k, v, g, beta, s0 = _inputs(b, 1, h, dk, dv, seed=b + h)
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    state = s0.clone()
    o = recurrent_gated_delta_rule_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert (o - o_ref[:, 0]).abs().max() < TOL and (state - s_ref).abs().max() < TOL


def _packed(lens, h=3, dk=16, dv=8, seed=0):
    q, k, v, g, beta, _ = _inputs(1, sum(lens), h, dk, dv, seed)
    s0 = torch.randn(len(lens), h, dk, dv, generator=torch.Generator().manual_seed(seed + 1)) * 0.3
    return [x[0] for x in (q, k, v, g, beta)], s0


@pytest.mark.parametrize("impl", [TorchDeltaRule(), TorchDeltaRule(chunk_size=64), TorchDeltaRule(chunk_size=7)],
                         ids=["torch-auto", "torch64", "torch7"])
@pytest.mark.parametrize("lens", [(1,), (1, 1, 1), (70, 1, 5, 129), (2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contract_against_the_naive_implementation(impl, lens, dtype):
    """`base.DeltaRuleKernels`: prefill leaves the states alone and returns o in v's dtype and
    float32 states; decode_ writes the state in place; both equal `NaiveDeltaRule`."""
    (q, k, v, g, beta), s0 = _packed(lens, seed=len(lens))
    v = v.to(dtype)
    ref = NaiveDeltaRule()
    keep = s0.clone()
    o, s = impl.prefill(q, k, v, g, beta, s0, lens)
    o_ref, s_ref = ref.prefill(q, k, v, g, beta, s0, lens)
    assert torch.equal(s0, keep) and o.dtype == dtype and s.dtype == torch.float32
    assert o.shape == v.shape and s.shape == s0.shape
    tol = TOL if dtype == torch.float32 else 2e-2  # bf16: o is rounded to 8 bits of mantissa
    assert (o.float() - o_ref.float()).abs().max() < tol and (s - s_ref).abs().max() < TOL
    rows = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    dec = [x[rows] for x in (q, k, v, g, beta)]
    state, state_ref = s.clone(), s.clone()
    od, od_ref = impl.decode_(*dec, state), ref.decode_(*dec, state_ref)
    assert od.dtype == dtype and od.shape == (len(lens), 3, 8)
    assert not torch.equal(state, s) and (state - state_ref).abs().max() < TOL
    assert (od.float() - od_ref.float()).abs().max() < tol


def test_auto_chunk_sizes_by_sequences_and_device_and_equal_the_fixed_sizes():
    """`chunk_size=None` picks 32 for one or two sequences and 16 for more on the CPU, 64
    elsewhere; the chunked form is exact at any size, so each auto call equals the same call
    at chunk 64 (transformers' size) and the naive loop."""
    from vlbatch.operators.kernels.delta_rule.torch_rule import auto_chunk

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [auto_chunk(lens, cpu) for lens in [(4096,), (3, 900), (1, 1, 1), (30,) * 64]] == [32, 32, 16, 16]
    assert auto_chunk((30,) * 64, cuda) == auto_chunk((4096,), cuda) == 64
    for lens in [(97,), (40, 33), (70, 1, 5, 129)]:  # both CPU branches, sequences over several chunks
        (q, k, v, g, beta), s0 = _packed(lens, seed=sum(lens))
        o, s = TorchDeltaRule().prefill(q, k, v, g, beta, s0, lens)
        o64, s64 = TorchDeltaRule(chunk_size=64).prefill(q, k, v, g, beta, s0, lens)
        o_ref, s_ref = NaiveDeltaRule().prefill(q, k, v, g, beta, s0, lens)
        assert (o - o64).abs().max() < TOL and (s - s64).abs().max() < TOL
        assert (o - o_ref).abs().max() < TOL and (s - s_ref).abs().max() < TOL


def test_selection_picks_torch_on_the_cpu_and_rejects_unknown_names():
    from vlbatch.operators.errors import ConfigError
    from vlbatch.operators.kernels.delta_rule import select_delta_rule

    assert select_delta_rule("cpu") == TorchDeltaRule() and select_delta_rule("cpu", "torch").name == "torch"
    assert select_delta_rule("cpu", "naive").name == "naive"  # the reference is a choice too
    with pytest.raises(ConfigError, match="model.engine.delta_rule: unknown .*allowed: auto, torch, fla, naive"):
        select_delta_rule("cpu", "flash")
