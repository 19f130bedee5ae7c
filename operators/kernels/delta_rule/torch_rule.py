"""The torch kernels of the gated delta rule (every device): the packed chunked rule for
prefill (`packed.py`) and the in-place recurrent step for decode (`chunked.py`; on the CPU
its compiled one-pass twin, `cpu_decode.py`, whenever the state allows)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vlbatch.operators.kernels.delta_rule import cpu_decode, cpu_scan
from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels
from vlbatch.operators.kernels.delta_rule.chunked import recurrent_gated_delta_rule_
from vlbatch.operators.kernels.delta_rule.packed import chunk_gated_delta_rule_packed
from vlbatch.operators.kernels.delta_rule.tuning import PrefillTuner, run_form

# Tokens per chunk of the packed chunked rule (prefill). The chunked form is exact at any
# size, so this is a speed choice: on the CPU the rule's elementwise work on its [C, C]
# blocks grows with C and the scan's per-step cost shrinks with it. Measured on one core
# (benchmarks/RESULTS_HISTORY.md, 2026-12-01): 16 is 1.5-1.9x faster than 64 from three sequences
# up (8 x 486, 27 x 88-216, 64 x 30 tokens), 32 the fastest for one or two long sequences
# (64 and 16 within 15 % there). Against a float64 loop 16 and 32 are a little more
# accurate than 64; logits against transformers (which chunks by 64) stay at ~1e-5
# (tests/test_model_parity.py). On CUDA 64, transformers' and fla's size: fewer sequential steps.
CPU_CHUNK, CPU_CHUNK_FEW, CUDA_CHUNK = 16, 32, 64


def auto_chunk(lens: tuple[int, ...], device: torch.device) -> int:
    """The prefill chunk for B = len(lens) packed sequences on `device` (see above)."""
    if device.type != "cpu":
        return CUDA_CHUNK
    return CPU_CHUNK_FEW if len(lens) <= 2 else CPU_CHUNK


@dataclass(frozen=True)
class TorchDeltaRule(DeltaRuleKernels):
    """`DeltaRuleKernels` in plain torch (+ numba on the CPU). `chunk_size`: the chunked form
    with that many tokens per chunk; None (default): the form `tuner` times on this machine at
    the first prefill (`tuning.py`; `auto_chunk` is the former fixed rule, kept for tests)."""

    chunk_size: int | None = None
    tuner: PrefillTuner = field(default_factory=PrefillTuner, compare=False)
    name: ClassVar[str] = "torch"

    @classmethod
    def create(cls, device) -> TorchDeltaRule:
        if torch.device(device).type == "cpu":
            cpu_decode.warm_up()  # at load, not in the first decode step
            cpu_scan.warm_up()
        return cls()

    def prefill(self, q, k, v, g, beta, state, lens):
        if self.chunk_size is not None:
            return chunk_gated_delta_rule_packed(q, k, v, g, beta, state, lens, self.chunk_size)
        return run_form(self.tuner.choose(q, v), q, k, v, g, beta, state, lens)

    def decode_(self, q, k, v, g, beta, state):
        if cpu_decode.usable(state):
            return cpu_decode.decode_step_cpu_(q, k, v, g, beta, state)
        return recurrent_gated_delta_rule_(q, k, v, g, beta, state)

    def decode_slots_(self, q, k, v, g, beta, pool, slots):
        if cpu_decode.usable(pool):
            return cpu_decode.decode_step_slots_cpu_(q, k, v, g, beta, pool, slots)
        return super().decode_slots_(q, k, v, g, beta, pool, slots)
