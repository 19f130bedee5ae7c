"""Causal GQA attention over paged K/V behind one contract (`base.PagedAttention`; the
step's index tensors are `layout.PagedLayout`).

`ATTENTION` names the implementations (the job config's `model.engine.attention` and its
schema take their choices from it); each target is called as `create(device)` once per
engine (its `ModelRunner`), and the instance owns reusable buffers, so each engine gets its
own. Importing this package imports no torch: a target's module is imported when chosen.
A new kernel: its module (a `PagedAttention` subclass) and one `Entry` below.
"""
from __future__ import annotations

from vlbatch.operators.registry import Entry, Registry

_PKG = "vlbatch.operators.kernels.attention"

ATTENTION = Registry("attention kernel", "model.engine.attention", "auto", (
    Entry("auto", f"{_PKG}.auto:auto", "cpu on the CPU, else sdpa"),
    Entry("sdpa", f"{_PKG}.torch_sdpa:SdpaPagedAttention.create",
          "gathers + torch scaled_dot_product_attention, every device"),
    Entry("cpu", f"{_PKG}.cpu_decode:CpuPagedAttention.create",
          "sdpa with decode rows by a numba paged-decode kernel (CPU float32)"),
    Entry("triton", f"{_PKG}.triton_decode:TritonPagedAttention.create",
          "sdpa with decode rows by a Triton paged-decode kernel (CUDA)"),
    Entry("naive", f"{_PKG}.naive:NaivePagedAttention.create", "a float64 loop: the test reference (slow)"),
), group="vlbatch.attention")

__all__ = ["ATTENTION", "select_attention"]


def select_attention(choice: str = "sdpa", device="cpu"):
    """A new `PagedAttention` of the `choice` implementation for caches on `device`."""
    return ATTENTION.load(choice)(device)
