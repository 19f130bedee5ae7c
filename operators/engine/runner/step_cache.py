"""`PagedStepCache`: the model's `StepCache` over the engine's paged K/V blocks and pooled DeltaNet
slots for one step (used by `model_runner.ModelRunner` and `static_decode.StaticDecode`)."""
from __future__ import annotations

import torch

from vlbatch.operators.engine.caches.state_pool import StatePool
from vlbatch.operators.kernels.attention.base import PagedAttention
from vlbatch.operators.kernels.attention.layout import PagedLayout


class PagedStepCache:
    """`StepCache` over paged K/V blocks and pooled DeltaNet slots for one step."""

    def __init__(self, kv: torch.Tensor, pool: StatePool, layout: PagedLayout, query_lens: tuple[int, ...],
                 slots: torch.Tensor, attention: PagedAttention, run: tuple[int, int] | None = None):
        self.kv, self.pool, self.layout, self.attend = kv, pool, layout, attention
        self._query_lens = query_lens
        self.slots = slots  # [B] pool slot of each sequence, packing order
        self.run = run  # `StatePool.contiguous_run` of the slots (host ints): views, no gather copies

    @property
    def query_lens(self) -> tuple[int, ...]:
        return self._query_lens

    def attention(self, attn_idx: int, q, k, v, rows=None):
        return self.attend(self.layout, self.kv[attn_idx, 0], self.kv[attn_idx, 1], q, k, v, rows)

    def linear_states(self, linear_idx: int):
        return self.pool.gather(linear_idx, self.slots, self.run)

    def set_linear_states(self, linear_idx: int, conv, recurrent) -> None:
        self.pool.scatter(linear_idx, self.slots, conv, recurrent, self.run)

    def linear_pools(self, linear_idx: int):
        """The pools and slots when the slots are scattered (a contiguous run: `linear_states`
        hands out views of the pool, already in place)."""
        if self.run is not None:
            return None
        return self.pool.conv[linear_idx], self.pool.recurrent[linear_idx], self.slots
