"""flash-linear-attention's (fla) Triton kernels of the gated delta rule, under the
`DeltaRuleKernels` contract (`base.py`); CUDA only.

fla's kernels run only on a GPU: on this project's CPU CI they are tested through this
adapter against a stand-in with fla's documented call signature
(tests/test_kernels_delta_rule.py says why). On a GPU machine
`python -m vlbatch.operators.kernels.delta_rule` compares fla's real kernels with the torch
ones on odd shapes (`check.compare_with_torch`) and prints the largest differences.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import ClassVar

import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels


@dataclass(frozen=True)
class FlaDeltaRule(DeltaRuleKernels):
    """fla's varlen `chunk_gated_delta_rule` (prefill) and `fused_recurrent_gated_delta_rule`
    (decode), or callables with their signatures (`fla_kernels` passes fla's own)."""

    chunk_fn: Callable
    recurrent_fn: Callable
    name: ClassVar[str] = "fla"

    @classmethod
    def create(cls, device) -> FlaDeltaRule:
        if torch.device(device).type != "cuda":
            raise ConfigError(f"model.engine.delta_rule='fla' needs a CUDA device, the model is on {device}")
        if not fla_installed():
            raise ConfigError("model.engine.delta_rule='fla' needs flash-linear-attention "
                              "(pip install flash-linear-attention)")
        return fla_kernels()

    def prefill(self, q, k, v, g, beta, state, lens):
        """The packed tokens are fla's one batch row [1, T, H, *] cut by `cu_seqlens` [B + 1];
        q is passed with scale 1 (already scaled); q, k, beta go in v's dtype as transformers
        passes them."""
        cu = torch.tensor([0, *accumulate(lens)], dtype=torch.long, device=q.device)
        dt = v.dtype
        o, new_state = self.chunk_fn(q.to(dt)[None], k.to(dt)[None], v[None], g.float()[None], beta.to(dt)[None],
                                     scale=1.0, initial_state=state.float(), output_final_state=True, cu_seqlens=cu)
        return o[0].to(dt), new_state.float()

    def decode_(self, q, k, v, g, beta, state):
        """B sequences of one token each are fla's [B, 1, H, *]; the final state is copied
        back into `state`."""
        dt = v.dtype
        o, new_state = self.recurrent_fn(q.to(dt)[:, None], k.to(dt)[:, None], v[:, None], g.float()[:, None],
                                         beta.to(dt)[:, None], scale=1.0, initial_state=state,
                                         output_final_state=True)
        state.copy_(new_state)
        return o[:, 0].to(dt)


def fla_kernels(chunk_fn=None, recurrent_fn=None) -> FlaDeltaRule:
    """fla's kernels under the contract; `chunk_fn` / `recurrent_fn` default to fla's own."""
    if chunk_fn is None or recurrent_fn is None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        chunk_fn = chunk_fn or chunk_gated_delta_rule
        recurrent_fn = recurrent_fn or fused_recurrent_gated_delta_rule
    return FlaDeltaRule(chunk_fn, recurrent_fn)


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None
