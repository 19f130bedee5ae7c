"""The contract between the model (math) and whoever stores its state (storage).

The model never owns cache memory. Each forward step receives a `StepCache`: a view
over the sequences in this step, in batch order, that

- knows how many new tokens each sequence brings (`query_lens`, packed in that order
  into the step's `[T, ...]` tensors, `T = sum(query_lens)`);
- stores and attends over full-attention K/V (`attention`), so the engine can back it
  with paged KV blocks and the model's own `ContiguousCache` with plain tensors;
- hands out and takes back the DeltaNet states of the step's sequences
  (`linear_states` / `set_linear_states`), so the engine can back them with a slot
  pool and snapshot / fork them at exact token positions; or, for a decode step over
  scattered slots, hands out the pools and the slots (`linear_pools`) to update in place.

Layer indices: `attn_idx` counts full-attention layers only (0..n_full-1) and
`linear_idx` counts DeltaNet layers only (0..n_linear-1), both in layer order.

Conv-state convention (same as transformers): `[B, C, K]` with `K =
linear_conv_kernel_dim`, holding the last K inputs of the causal conv (zeros before
the sequence start). Recurrent state: `[B, H_v, D_k, D_v]`, float32.

Implementations: `operators/model/contiguous_cache.py` (single process, contiguous
tensors; the reference) and the engine's paged cache (`operators/engine/`).
"""
from __future__ import annotations

from typing import Protocol

import torch


class StepCache(Protocol):
    """Per-step view of the cache for the sequences being run."""

    @property
    def query_lens(self) -> tuple[int, ...]:
        """New tokens of each sequence in this step, in packing order."""
        ...

    def attention(self, attn_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """Store the new K/V and attend causally over each sequence's cached + new tokens.

        q: [T, H_q, D] (after q-norm and MRoPE), k / v: [T, H_kv, D] (k after norm and MRoPE).
        Returns [T, H_q, D]: softmax(q k^T / sqrt(D)) v per sequence, causal, GQA
        (query head h reads kv head h // (H_q / H_kv)), computed in float32 or better.
        With `rows` [n] (ascending packed row indices), q is [n, H_q, D], the queries of
        those rows only, and the result is [n, H_q, D]; K/V of all T rows are still stored
        (the last layer needs only the rows whose logits are taken).
        """
        ...

    def linear_states(self, linear_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, C, K], recurrent [B, H_v, D_k, D_v]) of this step's B sequences.

        The model may update these tensors in place (decode does, for the recurrent state)
        and always passes the result to `set_linear_states`; an implementation hands out
        either its own storage (then storing is a no-op) or copies."""
        ...

    def set_linear_states(self, linear_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store the states after this step (same shapes as `linear_states`)."""
        ...

    def linear_pools(self, linear_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(conv pool [S, C, K], recurrent pool [S, H_v, D_k, D_v], slots [B]) when this step's
        states live in pools at scattered slots, so a decode step may update them there by index
        (`causal_conv1d_step_slots`, `DeltaRuleKernels.decode_slots_`) instead of through
        `linear_states` copies; None when `linear_states` hands out the storage itself."""
        ...
