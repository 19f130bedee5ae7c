"""Gated delta rule kernels behind one contract: this package's torch kernels, or
flash-linear-attention's (fla) Triton kernels on CUDA.

Contract of a `DeltaRuleKernels` (inputs as `GatedDeltaNet._heads` prepares them: q and k
L2-normalised and expanded to the H value heads, q already scaled by 1/sqrt(K); g (log
decay, <= 0) and beta float32):
- `prefill(q, k, v, g, beta, state, lens) -> (o, new_state)`: B sequences packed in `lens`
  order, q, k [T, H, K], v [T, H, V], g, beta [T, H], each from its own state
  [B, H, K, V] (not modified); o [T, H, V] in v's dtype, new_state [B, H, K, V] float32.
- `decode_(q, k, v, g, beta, state) -> o`: one token per sequence, q, k [B, H, K],
  v [B, H, V], g, beta [B, H]; `state` [B, H, K, V] float32 is overwritten with the state
  after the token; o [B, H, V] in v's dtype.

`select_kernels(device, choice)`: "torch" always works; "fla" needs CUDA and the `fla`
package (flash-linear-attention / fla-core); "auto" (the default of `load_model`) takes
fla on CUDA when it is installed, else torch. fla's kernels run only on a GPU: on this
project's CPU CI they are tested through the adapter below against a stand-in with fla's
documented call signature (tests/test_model_delta_kernels.py says why). On a GPU machine,
`python -m vlbatch.operators.model.ops.delta_kernels` compares fla's real kernels with the torch
ones on odd shapes (`compare_with_torch`) and prints the largest differences.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model.ops.delta_packed import chunk_gated_delta_rule_packed
from vlbatch.operators.model.ops.delta_rule import recurrent_gated_delta_rule_

CHOICES = ("auto", "torch", "fla")
# Tokens per chunk of the torch chunked rule (prefill). Shorter chunks are faster on CPU
# (16: ~40% less time in the rule) but pass the state through more roundings: logits drift
# ~1e-4 from transformers (which chunks by 64) instead of ~1e-5.
TORCH_CHUNK = 64


@dataclass(frozen=True)
class DeltaRuleKernels:
    """The two entry points of the module docstring's contract, and a name for logs."""

    name: str
    prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    decode_: Callable[..., torch.Tensor]


TORCH_KERNELS = DeltaRuleKernels("torch", partial(chunk_gated_delta_rule_packed, chunk_size=TORCH_CHUNK),
                                 recurrent_gated_delta_rule_)


def fla_prefill(q, k, v, g, beta, state, lens, *, chunk_fn):
    """The prefill contract through fla's varlen `chunk_gated_delta_rule`: the packed
    tokens are fla's one batch row [1, T, H, *] cut by `cu_seqlens` [B + 1]; q is passed
    with scale 1 (already scaled); q, k, beta go in v's dtype as transformers passes them."""
    cu = torch.tensor([0, *accumulate(lens)], dtype=torch.long, device=q.device)
    dt = v.dtype
    o, new_state = chunk_fn(q.to(dt)[None], k.to(dt)[None], v[None], g.float()[None], beta.to(dt)[None],
                            scale=1.0, initial_state=state.float(), output_final_state=True, cu_seqlens=cu)
    return o[0].to(dt), new_state.float()


def fla_decode_(q, k, v, g, beta, state, *, recurrent_fn):
    """The decode contract through fla's `fused_recurrent_gated_delta_rule`: B sequences of
    one token each are fla's [B, 1, H, *]; the final state is copied back into `state`."""
    dt = v.dtype
    o, new_state = recurrent_fn(q.to(dt)[:, None], k.to(dt)[:, None], v[:, None], g.float()[:, None],
                                beta.to(dt)[:, None], scale=1.0, initial_state=state, output_final_state=True)
    state.copy_(new_state)
    return o[:, 0].to(dt)


def fla_kernels(chunk_fn=None, recurrent_fn=None) -> DeltaRuleKernels:
    """fla's kernels under the contract; `chunk_fn` / `recurrent_fn` default to fla's own."""
    if chunk_fn is None or recurrent_fn is None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        chunk_fn = chunk_fn or chunk_gated_delta_rule
        recurrent_fn = recurrent_fn or fused_recurrent_gated_delta_rule
    return DeltaRuleKernels("fla", partial(fla_prefill, chunk_fn=chunk_fn),
                            partial(fla_decode_, recurrent_fn=recurrent_fn))


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def select_kernels(device: str | torch.device, choice: str = "auto") -> DeltaRuleKernels:
    """The kernels for a model on `device`: see the module docstring."""
    if choice not in CHOICES:
        raise ConfigError(f"delta_kernels={choice!r}; allowed: {', '.join(CHOICES)}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not (on_cuda and fla_installed())):
        return TORCH_KERNELS
    if not on_cuda:
        raise ConfigError(f"delta_kernels='fla' needs a CUDA device, the model is on {device}")
    if not fla_installed():
        raise ConfigError("delta_kernels='fla' needs flash-linear-attention (pip install flash-linear-attention)")
    return fla_kernels()


def compare_with_torch(kernels: DeltaRuleKernels, device="cpu", dtype=torch.float32,
                       lens=(1, 37, 64, 130, 5), heads=4, dk=128, dv=128, seed=0) -> dict[str, float]:
    """Largest |difference| between `kernels` and the torch kernels (float32 on the CPU, the
    reference) on packed sequences of `lens` tokens and one decode token each, from random
    states: {"prefill_o", "prefill_state", "decode_o", "decode_state"}."""
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lens), len(lens)
    q = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1)
    v, g = torch.randn(t, heads, dv, generator=gen), -torch.rand(t, heads, generator=gen)
    beta, state = torch.rand(t, heads, generator=gen), torch.randn(b, heads, dk, dv, generator=gen) * 0.1

    def on(x, float32=False):
        return x.to(device=device, dtype=torch.float32 if float32 else dtype)

    o_ref, s_ref = TORCH_KERNELS.prefill(q, k, v, g, beta, state, lens)
    o, s = kernels.prefill(on(q, True), on(k, True), on(v), on(g, True), on(beta, True), on(state, True), lens)
    rows = torch.tensor([0, *accumulate(lens)][:-1])  # one decode token per sequence: its first row's inputs
    dec = [x[rows] for x in (q, k, v, g, beta)]
    d_ref = s_ref.clone()
    do_ref = TORCH_KERNELS.decode_(*dec, d_ref)
    d = on(s_ref, True).clone()  # decode_ writes it; `.to` may return s_ref itself
    do = kernels.decode_(*(on(x, i != 2) for i, x in enumerate(dec)), d)

    def diff(a, ref):
        return float((a.float().cpu() - ref).abs().max())

    return {"prefill_o": diff(o, o_ref), "prefill_state": diff(s, s_ref), "decode_o": diff(do, do_ref),
            "decode_state": diff(d, d_ref)}


if __name__ == "__main__":  # on a GPU machine with fla installed: fla's kernels against ours
    for dt in (torch.float32, torch.bfloat16):
        print(f"fla vs torch kernels, {dt}: {compare_with_torch(select_kernels('cuda', 'fla'), 'cuda', dt)}")
