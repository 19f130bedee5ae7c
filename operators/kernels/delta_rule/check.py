"""The GPU check of a delta rule implementation against the torch kernels (float32 on the
CPU, the reference); `python -m vlbatch.operators.kernels.delta_rule` runs it for fla's."""
from __future__ import annotations

from itertools import accumulate

import torch

from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels
from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule


def compare_with_torch(kernels: DeltaRuleKernels, device="cpu", dtype=torch.float32,
                       lens=(1, 37, 64, 130, 5), heads=4, dk=128, dv=128, seed=0) -> dict[str, float]:
    """Largest |difference| between `kernels` and the torch kernels on packed sequences of
    `lens` tokens and one decode token each, from random states:
    {"prefill_o", "prefill_state", "decode_o", "decode_state"}."""
    ref = TorchDeltaRule()
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lens), len(lens)
    q = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1)
    v, g = torch.randn(t, heads, dv, generator=gen), -torch.rand(t, heads, generator=gen)
    beta, state = torch.rand(t, heads, generator=gen), torch.randn(b, heads, dk, dv, generator=gen) * 0.1

    def on(x, float32=False):
        return x.to(device=device, dtype=torch.float32 if float32 else dtype)

    o_ref, s_ref = ref.prefill(q, k, v, g, beta, state, lens)
    o, s = kernels.prefill(on(q, True), on(k, True), on(v), on(g, True), on(beta, True), on(state, True), lens)
    rows = torch.tensor([0, *accumulate(lens)][:-1])  # one decode token per sequence: its first row's inputs
    dec = [x[rows] for x in (q, k, v, g, beta)]
    d_ref = s_ref.clone()
    do_ref = ref.decode_(*dec, d_ref)
    d = on(s_ref, True).clone()  # decode_ writes it; `.to` may return s_ref itself
    do = kernels.decode_(*(on(x, i != 2) for i, x in enumerate(dec)), d)

    def diff(a, r):
        return float((a.float().cpu() - r).abs().max())

    return {"prefill_o": diff(o, o_ref), "prefill_state": diff(s, s_ref), "decode_o": diff(do, do_ref),
            "decode_state": diff(d, d_ref)}
