"""Swappable numerical kernels, one package per operation, each with one contract.

- `attention`: causal GQA attention over paged K/V (`PagedAttention`; torch SDPA, numba and
  Triton paged decode, naive).
- `delta_rule`: the gated delta rule of the DeltaNet layers (`DeltaRuleKernels`; torch
  chunked / recurrent, fla's Triton kernels on CUDA, naive).
- `moe`: the routed experts of the MoE FFN (`ExpertsKernel`; grouped matmul, padded
  batched matmul, per-expert loop).

Each package has `base.py` (the contract: shapes, dtypes, in-place semantics), one module
per implementation, its registry in `__init__.py` (`ATTENTION`, `DELTA_RULE`, `MOE`:
`operators/registry.py`; the job config's `model.engine.attention` / `delta_rule` / `moe`
choices come from them, and importing a package imports no torch), and a `select_*`
function that the loader (or the engine) calls once;
the chosen object is stored on the module that calls it, so hot paths never branch on a
backend name. Model-only ops that are not swappable (causal conv, RoPE) stay in
`operators/model`.
"""
