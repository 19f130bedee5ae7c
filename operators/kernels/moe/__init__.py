"""The MoE routed experts behind one contract (`base.ExpertsKernel`).

`MOE` names the implementations (the job config's `model.engine.moe` and its schema take
their choices from it); each target is called as `create(device, dtype, dim, inner)` once by
`load_model` for MoE checkpoints. Importing this package imports no torch: a target's module
is imported when chosen. A new kernel: its module (an `ExpertsKernel` subclass) and one
`Entry` below.
"""
from __future__ import annotations

from vlbatch.operators.registry import Entry, Registry

_PKG = "vlbatch.operators.kernels.moe"

MOE = Registry("MoE experts kernel", "model.engine.moe", "auto", (
    Entry("auto", f"{_PKG}.auto:auto", "grouped_mm where torch._grouped_mm takes the experts' shapes and dtype "
                                       "on this device, else padded"),
    Entry("grouped_mm", f"{_PKG}.grouped:GroupedMMExperts.create", "two torch._grouped_mm calls"),
    Entry("padded", f"{_PKG}.padded:PaddedExperts.create", "two padded torch.bmm calls, any device and dtype"),
    Entry("loop", f"{_PKG}.naive:LoopExperts.create", "a Python loop over the experts: the reference (slow)"),
), group="vlbatch.moe")

__all__ = ["MOE", "select_experts"]


def select_experts(device, dtype, dim: int, inner: int, choice: str = "auto"):
    """The `ExpertsKernel` of `choice` for [E, 2 * inner, dim] / [E, dim, inner] weights of `dtype` on `device`."""
    return MOE.load(choice)(device, dtype, dim, inner)
