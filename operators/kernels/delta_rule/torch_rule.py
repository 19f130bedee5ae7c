"""The torch kernels of the gated delta rule (every device): the packed chunked rule for
prefill (`packed.py`) and the in-place recurrent step for decode (`chunked.py`; on the CPU
its compiled one-pass twin, `cpu_decode.py`, whenever the state allows)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlbatch.operators.kernels.delta_rule import cpu_decode
from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels
from vlbatch.operators.kernels.delta_rule.chunked import recurrent_gated_delta_rule_
from vlbatch.operators.kernels.delta_rule.packed import chunk_gated_delta_rule_packed

# Tokens per chunk of the torch chunked rule (prefill). Shorter chunks are faster on CPU
# (16: ~40% less time in the rule) but pass the state through more roundings: logits drift
# ~1e-4 from transformers (which chunks by 64) instead of ~1e-5.
TORCH_CHUNK = 64


@dataclass(frozen=True)
class TorchDeltaRule(DeltaRuleKernels):
    """`DeltaRuleKernels` in plain torch; `chunk_size` tokens per prefill chunk."""

    chunk_size: int = TORCH_CHUNK
    name: ClassVar[str] = "torch"

    def prefill(self, q, k, v, g, beta, state, lens):
        return chunk_gated_delta_rule_packed(q, k, v, g, beta, state, lens, self.chunk_size)

    def decode_(self, q, k, v, g, beta, state):
        if cpu_decode.usable(state):
            return cpu_decode.decode_step_cpu_(q, k, v, g, beta, state)
        return recurrent_gated_delta_rule_(q, k, v, g, beta, state)
