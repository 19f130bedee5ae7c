"""Causal GQA attention over paged K/V behind one contract (`base.PagedAttention`; the
step's index tensors are `layout.PagedLayout`).

Implementations: `torch_sdpa.SdpaPagedAttention` (gathers + `scaled_dot_product_attention`,
every device; the default) and `naive.NaivePagedAttention` (a float64 loop, the test
reference) and `triton_decode.TritonPagedAttention` (SDPA's, with decode rows by a Triton
paged-decode kernel reading block tables; CUDA; imported only when chosen).
`select_attention(choice)` is called once per engine (its `ModelRunner`); the instance
owns reusable buffers, so each engine gets its own.
"""
from __future__ import annotations

import os

import torch

from vlbatch.operators.errors import ConfigError, SetupError
from vlbatch.operators.kernels.attention.base import PagedAttention
from vlbatch.operators.kernels.attention.layout import PagedLayout
from vlbatch.operators.kernels.attention.naive import NaivePagedAttention, attention_naive
from vlbatch.operators.kernels.attention.torch_sdpa import SdpaPagedAttention

CHOICES = ("sdpa", "naive", "triton", "cpu", "auto")

__all__ = ["CHOICES", "NaivePagedAttention", "PagedAttention", "PagedLayout", "SdpaPagedAttention",
           "attention_naive", "select_attention"]


def select_attention(choice: str = "sdpa", device="cpu") -> PagedAttention:
    """A new instance of the `choice` implementation (see the module docstring); `device`
    (where the caches live) resolves `auto`."""
    if choice not in CHOICES:
        raise ConfigError(f"attention {choice!r}; allowed: {', '.join(CHOICES)}")
    if choice == "auto":
        choice = "cpu" if torch.device(device).type == "cpu" else "sdpa"
    if choice == "cpu":  # numba: imported when chosen
        from vlbatch.operators.kernels.attention.cpu_decode import CpuPagedAttention

        return CpuPagedAttention()
    if choice == "triton":
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SetupError(f"model.engine.attention=triton is a CUDA kernel but the engine runs on {device!r} "
                             "(use auto, or a GPU); TRITON_INTERPRET=1 runs it on the CPU for tests")
        from vlbatch.operators.kernels.attention.triton_decode import TritonPagedAttention

        return TritonPagedAttention()
    return SdpaPagedAttention() if choice == "sdpa" else NaivePagedAttention()
