"""Model-only numerical ops of the decoder (not swappable kernels), each with a naive reference beside it.

- `conv`: the DeltaNet causal depthwise conv1d (prefill from a state, packed sequences,
  one-step update, naive); `conv_cpu`: its step and packed forms as numba loops (CPU float32).
- `norm_cpu` (RMSNorm, gated RMSNorm), `heads_cpu` (DeltaNet q / k L2 norm + head expansion),
  `rope_cpu` (attention q / k RMSNorm + partial MRoPE): one numba pass each on CPU float32, the
  torch twin beside each.
- `pixels_cpu`: uint8 frames -> normalised patches in the processor's layout in one numba pass
  (the vision tower's input; `model/pixels.normalize_frames` picks it on CPU float32).

`cpu.cpu_float32` says where the compiled forms apply; `warm_up.warm_up_cpu` loads them all.
`__init__` imports none of the package's modules, so they import one way (no cycle).

The swappable kernels (attention, the gated delta rule, MoE experts) are in
`operators/kernels/`.
"""
