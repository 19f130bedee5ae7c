"""Numerical kernels of the decoder, in plain PyTorch, each with a naive reference beside it.

- `delta_rule`: gated delta rule (chunked prefill, batched recurrent decode, naive loop).
- `conv`: the DeltaNet causal depthwise conv1d (prefill from a state, one-step update, naive).
"""
