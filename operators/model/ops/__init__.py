"""Model-only numerical ops of the decoder (not swappable kernels), each with a naive reference beside it.

- `conv`: the DeltaNet causal depthwise conv1d (prefill from a state, packed sequences,
  one-step update, naive); `conv_cpu`: its step and packed forms as numba loops (CPU float32).

The swappable kernels (attention, the gated delta rule, MoE experts) are in
`operators/kernels/`.
"""
