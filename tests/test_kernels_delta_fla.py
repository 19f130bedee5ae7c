"""fla's kernels of the gated delta rule (operators/kernels/delta_rule/fla_rule.py) and the choice.

fla's Triton kernels need a GPU, which CI does not have, and the Triton interpreter does not
run them on the CPU (seen on 2026-11-30 with fla-core 0.6.0 / triton 3.8: the chunked kernel
fails inside the interpreter, the recurrent one returns NaN). So fla itself is replaced here
by a stand-in with fla's documented call signature (`[B, T, H, *]` inputs, `cu_seqlens`
cutting one packed row into sequences, `scale` applied to q, `initial_state [N, H, K, V]`,
returning `(o, final_state)`) computed by the seed's naive loop. What is tested is our side:
the adapter's packing, scaling, dtypes and state handling, and the selection rules. The real
kernels are compared with the torch ones on a GPU by `python -m vlbatch.operators.kernels.delta_rule`
(`check.compare_with_torch`, itself tested here on the stand-in).
"""
from __future__ import annotations

import pytest
import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels.delta_rule import fla_rule, select_delta_rule
from vlbatch.operators.kernels.delta_rule.check import compare_with_torch
from vlbatch.operators.kernels.delta_rule.naive import delta_rule_naive
from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule


def _naive_rows(q, k, v, g, beta, scale, state):
    """One sequence [L, H, *] from state [H, K, V] -> (o [L, H, V], state); scale None = 1/sqrt(K), as fla."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, s = delta_rule_naive((q * scale).float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                            v.float().transpose(0, 1)[None], g.float().exp().t()[None], beta.float().t()[None],
                            state.float()[None])
    return o[0].transpose(0, 1), s[0]


class FlaStandIn:
    """fla's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` signatures over the
    naive loop; records the calls so the tests see what the adapter passed."""

    def __init__(self):
        self.calls = []

    def chunk(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        self.calls.append(("chunk", q.shape, cu_seqlens.tolist(), scale))
        assert q.shape[0] == 1 and output_final_state  # varlen: one packed row
        init = initial_state.clone()
        cu = cu_seqlens.tolist()
        outs, states = [], []
        for i in range(len(cu) - 1):
            sl = slice(cu[i], cu[i + 1])
            o, s = _naive_rows(q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl], scale, initial_state[i])
            outs.append(o)
            states.append(s)
        assert torch.equal(init, initial_state)  # fla does not write the initial state
        return torch.cat(outs)[None].to(v.dtype), torch.stack(states)

    def recurrent(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        self.calls.append(("recurrent", q.shape, None, scale))
        assert q.shape[1] == 1 and output_final_state
        rows = [_naive_rows(q[b], k[b], v[b], g[b], beta[b], scale, initial_state[b]) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in rows]).to(v.dtype), torch.stack([s for _, s in rows])


def _inputs(t, h=4, dk_=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk_, generator=gen), dim=-1) * dk_**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk_, generator=gen), dim=-1)
    v, g = torch.randn(t, h, dv, generator=gen), -torch.rand(t, h, generator=gen)
    return q, k, v, g, torch.rand(t, h, generator=gen)


@pytest.mark.parametrize("lens", [(5, 70, 1, 33), (1,), (129, 2)])
def test_fla_prefill_adapter_equals_the_torch_kernels(lens):
    fake = FlaStandIn()
    q, k, v, g, beta = _inputs(sum(lens))
    state = torch.randn(len(lens), 4, 16, 8, generator=torch.Generator().manual_seed(1)) * 0.1
    before = state.clone()
    o_ref, s_ref = TorchDeltaRule().prefill(q, k, v, g, beta, state, lens)
    o, s = fla_rule.fla_kernels(fake.chunk, fake.recurrent).prefill(q, k, v, g, beta, state, lens)
    assert torch.equal(state, before)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape and s.dtype == torch.float32
    assert (o - o_ref).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    assert fake.calls == [("chunk", (1, sum(lens), 4, 16), cu, 1.0)]  # q is scaled already: scale 1


def test_fla_decode_adapter_updates_the_state_in_place_like_the_torch_kernel():
    fake = FlaStandIn()
    q, k, v, g, beta = _inputs(3, seed=2)
    state = torch.randn(3, 4, 16, 8, generator=torch.Generator().manual_seed(3))
    ours, theirs = state.clone(), state.clone()
    o_ref = TorchDeltaRule().decode_(q, k, v, g, beta, ours)
    o = fla_rule.fla_kernels(fake.chunk, fake.recurrent).decode_(q, k, v, g, beta, theirs)
    assert (o - o_ref).abs().max() < 1e-5 and (theirs - ours).abs().max() < 1e-5
    assert not torch.equal(theirs, state)  # written in place
    assert fake.calls == [("recurrent", (3, 1, 4, 16), None, 1.0)]


def test_deltanet_layer_with_fla_kernels_equals_torch_on_a_mixed_step(tiny_ckpt):
    """Decodes and chunks of different lengths in one step, through the layer's own paths."""
    from vlbatch.operators.model import ContiguousCache, load_model

    model = load_model(tiny_ckpt("dense"))
    cfg = model.config.text
    layer = model.language_model.layers[cfg.linear_layers[0]].linear_attn
    lens = (1, 7, 65, 1, 3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), cfg.hidden_size, generator=gen)
    conv0 = torch.randn(len(lens), cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, generator=gen)
    rec0 = torch.randn(len(lens), cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                       generator=gen) * 0.1

    def run():
        cache = ContiguousCache(cfg, len(lens), capacity=1)
        cache.set_linear_states(0, conv0.clone(), rec0.clone())  # the layer updates them in place
        cache.begin_step(lens)
        return layer(x, cache, 0), cache.recurrent[0].clone()

    assert layer.kernels == TorchDeltaRule()  # what load_model picks on the CPU
    out_ref, rec_ref = run()
    fake = FlaStandIn()
    model.use_delta_kernels(fla_rule.fla_kernels(fake.chunk, fake.recurrent))
    out, rec = run()
    assert {c[0] for c in fake.calls} == {"chunk", "recurrent"}  # both paths went through the stand-in
    assert (out - out_ref).abs().max() < 1e-5 and (rec - rec_ref).abs().max() < 1e-5


def test_selection_rules(monkeypatch, tiny_ckpt):
    sentinel = fla_rule.FlaDeltaRule(None, None)
    monkeypatch.setattr(fla_rule, "fla_kernels", lambda: sentinel)
    monkeypatch.setattr(fla_rule, "fla_installed", lambda: True)
    assert select_delta_rule("cpu") == TorchDeltaRule()  # fla only runs on CUDA
    assert select_delta_rule("cuda") is sentinel and select_delta_rule("cuda:1", "fla") is sentinel
    assert select_delta_rule("cuda", "torch") == TorchDeltaRule()
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        select_delta_rule("cpu", "fla")
    monkeypatch.setattr(fla_rule, "fla_installed", lambda: False)
    assert select_delta_rule("cuda") == TorchDeltaRule()  # the fallback
    with pytest.raises(ConfigError, match="needs flash-linear-attention"):
        select_delta_rule("cuda", "fla")
    with pytest.raises(ConfigError, match="model.engine.delta_rule: unknown .*allowed: auto, torch, fla, naive"):
        select_delta_rule("cpu", "triton")
    from vlbatch.operators.model import load_model

    with pytest.raises(ConfigError, match="delta_rule='fla' needs a CUDA device"):
        load_model(tiny_ckpt("dense"), delta_rule="fla")


class _Unscaled(TorchDeltaRule):
    """A wrong kernel: q doubled (the scale applied twice, say)."""

    def prefill(self, q, *args):
        return super().prefill(q * 2, *args)

    def decode_(self, q, *args):
        return super().decode_(q * 2, *args)


def test_compare_with_torch_sees_a_wrong_kernel():
    """The GPU check's own function: ~0 for a faithful implementation, large for a wrong one."""
    fake = FlaStandIn()
    good = compare_with_torch(fla_rule.fla_kernels(fake.chunk, fake.recurrent), dk=16, dv=8)
    assert set(good) == {"prefill_o", "prefill_state", "decode_o", "decode_state"} and max(good.values()) < 1e-5
    bad = compare_with_torch(_Unscaled(), dk=16, dv=8)
    assert bad["prefill_o"] > 1e-2 and bad["decode_o"] > 1e-2 and bad["prefill_state"] < 1e-6
