"""Loading every compiled CPU op of the decoder before the first engine step."""
from __future__ import annotations

from vlbatch.operators.model.ops import conv_cpu, heads_cpu, norm_cpu, pixels_cpu, rope_cpu


def warm_up_cpu() -> None:
    """Load (the first time on a machine: compile and cache, ~4 s) every compiled CPU op of the
    decoder, for each array layout the decoder passes, so that the first engine step runs
    compiled code rather than the JIT (`load_model` calls it for a CPU float32 model;
    tests/test_model_warm_up.py checks that a generate then compiles nothing)."""
    for module in (conv_cpu, heads_cpu, norm_cpu, pixels_cpu, rope_cpu):
        module.warm_up()
