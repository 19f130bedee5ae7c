"""Model-only numerical ops of the decoder (not swappable kernels), each with a naive reference beside it.

- `conv`: the DeltaNet causal depthwise conv1d (prefill from a state, packed sequences,
  one-step update, naive); `conv_cpu`: its step and packed forms as numba loops (CPU float32).
- `norm_cpu` (RMSNorm, gated RMSNorm), `heads_cpu` (DeltaNet q / k L2 norm + head expansion),
  `rope_cpu` (attention q / k RMSNorm + partial MRoPE): one numba pass each on CPU float32, the
  torch twin beside each.
- `pixels_cpu`: uint8 frames -> normalised patches in the processor's layout in one numba pass
  (the vision tower's input; `model/pixels.normalize_frames` picks it on CPU float32).

The swappable kernels (attention, the gated delta rule, MoE experts) are in
`operators/kernels/`.
"""
from __future__ import annotations

import torch


def cpu_float32(*tensors: torch.Tensor) -> bool:
    """Every tensor on the CPU in float32 (any strides: the compiled ops read numpy views). Asked
    per layer and step: a plain loop (`all` over a generator and `.device.type` cost ~4x more)."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True


def warm_up_cpu() -> None:
    """Load (the first time on a machine: compile and cache, ~4 s) every compiled CPU op of the
    decoder, for each array layout the decoder passes, so that the first engine step runs
    compiled code rather than the JIT (`load_model` calls it for a CPU float32 model;
    tests/test_model_warm_up.py checks that a generate then compiles nothing)."""
    from vlbatch.operators.model.ops import conv_cpu, heads_cpu, norm_cpu, pixels_cpu, rope_cpu

    for module in (conv_cpu, heads_cpu, norm_cpu, pixels_cpu, rope_cpu):
        module.warm_up()
