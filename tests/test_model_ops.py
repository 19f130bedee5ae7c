"""The DeltaNet causal conv (operators/model/ops/conv.py) against its naive reference, and
the DeltaNet layer's ragged step against each sequence alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlbatch.operators.model.ops.conv import (
    causal_conv1d_naive,
    causal_conv1d_packed,
    causal_conv1d_prefill,
    causal_conv1d_step,
)


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


@pytest.mark.parametrize("lens", [(1, 2, 1), (3, 1, 1, 12, 7), (37,)])
@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_conv_compiled_forms_equal_torch_twins_and_naive(lens, kernel):
    """The numba loops (`conv_cpu`) against the torch forms and the naive loop, odd shapes
    (C = 11, sequences shorter than the kernel) and strided inputs (a view of a wider
    projection, as the fused DeltaNet projection hands over)."""
    from vlbatch.operators.model.ops import conv_cpu
    from vlbatch.operators.model.ops.conv import causal_conv1d_packed_torch, causal_conv1d_step_torch

    g = torch.Generator().manual_seed(sum(lens) + 10 * kernel)
    wide = torch.randn(sum(lens), 17, generator=g)
    x = wide[:, 3:14]  # [T, 11], row stride 17
    w = torch.randn(11, kernel, generator=g)
    state = torch.randn(len(lens), 11, kernel, generator=g)
    assert conv_cpu.usable(x, w, state)
    out, new_state = conv_cpu.conv1d_packed_cpu(x, w, state, lens)
    twin, twin_state = causal_conv1d_packed_torch(x, w, state, lens)
    assert (out - twin).abs().max() < 1e-5 and torch.equal(new_state, twin_state)
    start = 0
    for i, n in enumerate(lens):
        ref, ref_state = causal_conv1d_naive(x[start: start + n].t()[None], w, state[i: i + 1])
        assert (out[start: start + n] - ref[0].t()).abs().max() < 1e-5 and torch.equal(new_state[i], ref_state[0])
        start += n
    step_x = wide[: len(lens), 2:13]  # [B, 11] strided, one token per sequence
    o, st = conv_cpu.conv1d_step_cpu(step_x, w, state)
    o_twin, st_twin = causal_conv1d_step_torch(step_x, w, state)
    ref, ref_state = causal_conv1d_naive(step_x[:, :, None], w, state)
    assert (o - o_twin).abs().max() < 1e-5 and (o - ref[:, :, 0]).abs().max() < 1e-5
    assert torch.equal(st, st_twin) and torch.equal(st, ref_state)
    # in place (the decode step gives up its pool view): the same results, written over the state
    given = state.clone()
    o_in, st_in = conv_cpu.conv1d_step_cpu(step_x, w, given, inplace=True)
    assert st_in.data_ptr() == given.data_ptr() and torch.equal(st_in, ref_state) and torch.equal(o_in, o)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["compiled", "torch"])
def test_conv_step_by_slot_updates_the_pool_in_place(dtype):
    """`causal_conv1d_step_slots` (CPU float32: the compiled loop indexing the pool; else
    gather, step, store back) equals the step on the gathered states; other slots untouched."""
    from vlbatch.operators.model.ops.conv import causal_conv1d_step_slots

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 17, generator=g)
    x = wide[:, 2:13].to(dtype)  # [B, 11] strided, as the fused projection hands over
    w = torch.randn(11, 4, generator=g).to(dtype)
    pool = torch.randn(7, 11, 4, generator=g).to(dtype)
    slots = torch.tensor([5, 0, 3, 1])
    ref, ref_state = causal_conv1d_step(x, w, pool[slots].clone())
    before = pool.clone()
    out = causal_conv1d_step_slots(x, w, pool, slots)
    assert (out.float() - ref.float()).abs().max() < 1e-2 and torch.equal(pool[slots], ref_state.to(dtype))
    assert torch.equal(pool[[2, 4, 6]], before[[2, 4, 6]])
