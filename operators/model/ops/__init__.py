"""Numerical kernels of the decoder, in plain PyTorch, each with a naive reference beside it.

- `delta_rule`: gated delta rule (chunked prefill, batched recurrent decode, in-place
  decode, naive loop).
- `delta_packed`: the chunked rule over sequences of different lengths packed together.
- `delta_kernels`: the contract the DeltaNet layer calls the rule through, with two
  implementations: these torch kernels, or flash-linear-attention's Triton kernels on CUDA.
- `conv`: the DeltaNet causal depthwise conv1d (prefill from a state, packed sequences,
  one-step update, naive).
"""
