"""The gated delta rule behind one contract (`base.DeltaRuleKernels`: packed prefill from
per-sequence states, in-place decode).

`DELTA_RULE` names the implementations (the job config's `model.engine.delta_rule` and its
schema take their choices from it); each target is called as `create(device)` once by
`load_model`. Importing this package imports no torch: a target's module is imported when
chosen. A new kernel: its module (a `DeltaRuleKernels` subclass) and one `Entry` below.
The torch kernels are built on `packed.py` and `chunked.py`, on the CPU with the compiled
decode step of `cpu_decode.py` and packed-prefill scan of `cpu_scan.py`.
`python -m vlbatch.operators.kernels.delta_rule` is the GPU check (`check.py`).
"""
from __future__ import annotations

from vlbatch.operators.registry import Entry, Registry

_PKG = "vlbatch.operators.kernels.delta_rule"

DELTA_RULE = Registry("gated delta rule kernel", "model.engine.delta_rule", "auto", (
    Entry("auto", f"{_PKG}.auto:auto", "fla on CUDA when flash-linear-attention is installed, else torch"),
    Entry("torch", f"{_PKG}.torch_rule:TorchDeltaRule.create",
          "torch chunked prefill and recurrent decode (numba-compiled on the CPU), every device"),
    Entry("fla", f"{_PKG}.fla_rule:FlaDeltaRule.create", "flash-linear-attention's Triton kernels (CUDA)"),
    Entry("naive", f"{_PKG}.naive:NaiveDeltaRule.create", "a per-token loop: the test reference (slow)"),
), group="vlbatch.delta_rule")

__all__ = ["DELTA_RULE", "select_delta_rule"]


def select_delta_rule(device, choice: str = "auto"):
    """The `DeltaRuleKernels` of `choice` for a model on `device`."""
    return DELTA_RULE.load(choice)(device)
