"""The contract of the gated delta rule's kernels (what `GatedDeltaNet` calls).

Recurrence per head (seed 000 sections 9.6 and 9.11), with S [K, V]:

    S_t = exp(g_t) * S_{t-1};  d_t = beta_t * (v_t - S_t^T k_t);  S_t = S_t + k_t d_t^T;  o_t = S_t^T q_t

Inputs are as `GatedDeltaNet._heads` prepares them: q and k L2-normalised and expanded to
the H value heads, q already scaled by 1/sqrt(K); q, k float32, v in the model dtype; g
(log decay, <= 0) and beta float32.
"""
from __future__ import annotations

from typing import ClassVar

import torch


class DeltaRuleKernels:
    """Prefill and decode of the gated delta rule; `name` is for logs.

    - `prefill(q, k, v, g, beta, state, lens) -> (o, new_state)`: B sequences packed in
      `lens` order (a tuple of B ints >= 1, T = sum), q, k [T, H, K], v [T, H, V], g, beta
      [T, H], each from its own state [B, H, K, V] float32, which is NOT modified;
      o [T, H, V] in v's dtype, new_state [B, H, K, V] float32 (a new tensor).
    - `decode_(q, k, v, g, beta, state) -> o`: one token per sequence, q, k [B, H, K],
      v [B, H, V], g, beta [B, H]; `state` [B, H, K, V] float32 is overwritten in place
      with the state after the token; o [B, H, V] in v's dtype.
    - `decode_slots_(q, k, v, g, beta, pool, slots) -> o`: as `decode_` for the states
      `pool[slots]` (pool [S, H, K, V] float32, slots [B] int64, distinct), updated in place in
      the pool: the engine's decode step when its sequences' slots are not one contiguous run.
      The default gathers, runs `decode_` and stores back; a kernel that can index the pool
      itself overrides it (the CPU step: no [B, H, K, V] copy either way).

    A new implementation: a subclass in its own module, and one `Entry` in `DELTA_RULE`
    (`delta_rule/__init__.py`), whose target is its `create`.
    """

    name: ClassVar[str] = "base"

    @classmethod
    def create(cls, device) -> DeltaRuleKernels:
        """The kernels for a model on `device` (called once by `load_model`, before the weights
        load); override to refuse a device (raise `ConfigError`) or to prepare for it."""
        return cls()

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, lens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def decode_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_slots_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        state = pool.index_select(0, slots)
        out = self.decode_(q, k, v, g, beta, state)
        pool.index_copy_(0, slots, state)
        return out
