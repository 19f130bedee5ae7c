"""DeltaNet kernels against their naive references, over odd lengths and non-zero states."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlbatch.operators.model.ops.conv import causal_conv1d_naive, causal_conv1d_prefill, causal_conv1d_step
from vlbatch.operators.model.ops.delta_rule import (
    chunk_gated_delta_rule,
    delta_rule_naive,
    recurrent_gated_delta_rule,
)

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


@pytest.mark.parametrize("length", [1, 3, 9])
@pytest.mark.parametrize("kernel", [2, 4])
def test_conv_prefill_and_step_equal_naive(length, kernel):
    g = torch.Generator().manual_seed(length * kernel)
    x = torch.randn(2, 6, length, generator=g)
    w = torch.randn(6, kernel, generator=g)
    state = torch.randn(2, 6, kernel, generator=g)
    ref, ref_state = causal_conv1d_naive(x, w, state)
    out, new_state = causal_conv1d_prefill(x, w, state)
    assert (out - ref).abs().max() < 1e-5 and torch.equal(new_state, ref_state)
    st, outs = state, []
    for t in range(length):
        o, st = causal_conv1d_step(x[:, :, t], w, st)
        outs.append(o)
    assert (torch.stack(outs, dim=-1) - ref).abs().max() < 1e-5 and torch.equal(st, ref_state)


def test_conv_zero_state_matches_padded_conv_and_continues():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 12, generator=g)
    w = torch.randn(5, 4, generator=g)
    padded = F.silu(F.conv1d(x, w.unsqueeze(1), padding=3, groups=5)[:, :, :12])
    out, state = causal_conv1d_prefill(x, w)
    assert (out - padded).abs().max() < 1e-5
    first, mid = causal_conv1d_prefill(x[:, :, :5], w)
    second, end = causal_conv1d_prefill(x[:, :, 5:], w, mid)
    assert (torch.cat([first, second], -1) - out).abs().max() < 1e-5 and torch.equal(end, state)


@pytest.mark.parametrize("shape", [(5, 3, 7, 5), (1, 1, 64, 64), (64, 8, 16, 4)])
def test_recurrent_odd_shapes_and_input_state_left_intact(shape):
    b, h, dk, dv = shape
    q, k, v, g, beta, s0 = _inputs(b, 3, h, dk, dv, seed=b * h)
    keep = s0.clone()
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o - o_ref).abs().max() < TOL and (s - s_ref).abs().max() < TOL
    assert torch.equal(s0, keep)  # the caller's state (a pool view) is never written


@pytest.mark.parametrize("lengths", [(1, 9, 4), (3, 3, 3), (9, 1, 2)])
def test_conv_prefill_right_padded_takes_each_state_at_its_length(lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    m = max(lengths)
    x = torch.randn(len(lengths), 6, m, generator=g)
    w = torch.randn(6, 4, generator=g)
    state = torch.randn(len(lengths), 6, 4, generator=g)
    out, new_state = causal_conv1d_prefill(x, w, state, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        ref, ref_state = causal_conv1d_naive(x[i : i + 1, :, :n], w, state[i : i + 1])
        assert (out[i : i + 1, :, :n] - ref).abs().max() < 1e-5 and torch.equal(new_state[i : i + 1], ref_state)


def test_deltanet_ragged_step_equals_each_sequence_alone(tiny_ckpt):
    """Decodes, short chunks of different lengths (batched, right-padded) and long chunks
    (equal lengths batched) in one step give what each sequence gives alone."""
    from vlbatch.operators.model import ContiguousCache, load_model

    model = load_model(tiny_ckpt("dense"))
    cfg = model.config.text
    layer = model.language_model.layers[cfg.linear_layers[0]].linear_attn
    lens = (1, 7, 64, 65, 3, 1, 130, 7, 65)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), cfg.hidden_size, generator=gen)
    conv0 = torch.randn(len(lens), cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, generator=gen)
    rec0 = torch.randn(len(lens), cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                       generator=gen) * 0.1

    def run(rows, sel, step_lens):
        cache = ContiguousCache(cfg, len(sel), capacity=1)
        cache.set_linear_states(0, conv0[sel], rec0[sel])
        cache.begin_step(step_lens)
        return layer(x[rows], cache, 0), cache.conv[0], cache.recurrent[0]

    out, conv, rec = run(slice(None), list(range(len(lens))), lens)
    start = 0
    for i, n in enumerate(lens):
        o, c, r = run(slice(start, start + n), [i], (n,))
        assert (out[start : start + n] - o).abs().max() < 1e-5, f"sequence {i} ({n} tokens)"
        assert (conv[i] - c[0]).abs().max() < 1e-6 and (rec[i] - r[0]).abs().max() < 1e-5
        start += n


@pytest.mark.parametrize("lens", [(1, 9, 4, 2), (5,), (3, 1, 1, 12, 7)])
@pytest.mark.parametrize("kernel", [2, 4])
def test_conv_packed_equals_naive_per_sequence(lens, kernel):
    from vlbatch.operators.model.ops.conv import causal_conv1d_packed

    g = torch.Generator().manual_seed(sum(lens) * kernel)
    x = torch.randn(sum(lens), 6, generator=g)
    w = torch.randn(6, kernel, generator=g)
    state = torch.randn(len(lens), 6, kernel, generator=g)
    out, new_state = causal_conv1d_packed(x, w, state, lens)
    start = 0
    for i, n in enumerate(lens):
        ref, ref_state = causal_conv1d_naive(x[start: start + n].t()[None], w, state[i: i + 1])
        assert (out[start: start + n] - ref[0].t()).abs().max() < 1e-5 and torch.equal(new_state[i], ref_state[0])
        start += n


@pytest.mark.parametrize("lens", [(5, 130, 64, 65, 1, 200, 3), (2, 2), (33,)])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_packed_chunked_equals_naive_per_sequence(lens, chunk):
    from vlbatch.operators.model.ops.delta_packed import chunk_gated_delta_rule_packed

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
    from vlbatch.operators.model.ops.delta_packed import chunk_gated_delta_rule_packed

    q, k, v, g, beta, s0 = _inputs(1, 70, 2, 8, 8, seed=9)
    g = g * 60  # log decays down to -30 per token: products of many fall below 1e-35
    o, s = chunk_gated_delta_rule_packed(q[0], k[0], v[0], g[0], beta[0], s0, (70,), 64)
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    assert (o - o_ref[0]).abs().max() < TOL and (s - s_ref).abs().max() < TOL


@pytest.mark.parametrize("shape", [(5, 3, 7, 5), (64, 8, 16, 4)])
def test_recurrent_in_place_equals_naive(shape):
    from vlbatch.operators.model.ops.delta_rule import recurrent_gated_delta_rule_

    b, h, dk, dv = shape
    q, k, v, g, beta, s0 = _inputs(b, 1, h, dk, dv, seed=b + h)
    o_ref, s_ref = _naive(q, k, v, g, beta, s0)
    state = s0.clone()
    o = recurrent_gated_delta_rule_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert (o - o_ref[:, 0]).abs().max() < TOL and (state - s_ref).abs().max() < TOL
