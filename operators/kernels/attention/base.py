"""The contract of attention over paged K/V (what the engine's `PagedStepCache.attention` calls)."""
from __future__ import annotations

from typing import ClassVar

import torch

from vlbatch.operators.kernels.attention.layout import PagedLayout


class PagedAttention:
    """`attention(layout, k_cache, v_cache, q, k, v, rows=None) -> out`, for one full-attention layer:

    - `layout`: the step's `PagedLayout` (slots of the new tokens, context slots per sequence);
    - k_cache / v_cache [num_blocks, bs, H_kv, D] (model dtype): written IN PLACE: the new
      k / v [T, H_kv, D] (all T packed rows, in `layout`'s order) are stored at
      `layout.slot_mapping` before attending;
    - q [T, H_q, D] (after q-norm and RoPE), H_q a multiple of H_kv (GQA: query head h
      reads kv head h // (H_q / H_kv));
    - out [T, H_q, D] float32: softmax(q k^T / sqrt(D)) v per sequence, causal over its
      cached + new tokens (a row at position p sees positions 0..p);
    - with `rows` [n] (ascending packed row indices) q is [n, H_q, D], the queries of those
      rows only, and out is [n, H_q, D]; K/V of all T rows are still stored.

    An implementation may keep reusable buffers (one instance per engine); `name` is for logs.
    A new implementation: a subclass in its own module, and one `Entry` in `ATTENTION`
    (`attention/__init__.py`), whose target is its `create`.
    """

    name: ClassVar[str] = "base"

    @classmethod
    def create(cls, device) -> PagedAttention:
        """A new instance for caches on `device` (called once per engine); override to refuse
        a device (raise `SetupError`) or to prepare for it."""
        return cls()

    def __call__(self, layout: PagedLayout, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError
