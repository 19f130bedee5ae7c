"""The gated delta rule's decode step on the CPU as one compiled pass over the state (numba).

`decode_step_cpu_(q, k, v, g, beta, state)` is `chunked.recurrent_gated_delta_rule_` (the
torch step, its reference beside it; both are tested against `naive.NaiveDeltaRule`) with
the same algebra per (sequence, head):

    r_q = S^T q,  r_k = S^T k              one read of S [K, V] (16 KiB at K = V = 64: L1)
    d = beta (v - exp(g) r_k);  o = exp(g) r_q + (q . k) d
    S = exp(g) S + k d^T                   written while S is still in L1

so the state crosses memory once (read + write) instead of the three passes of the torch
step, and no [B, H, K, V] temporary exists. The kernel is `cpu_scan.scan_kernel` (the packed
prefill's token scan) with one token per sequence. `decode_step_slots_cpu_` is the same kernel
reading and writing the states where the engine's pool keeps them (`pool[slots]`), so a step
whose sequences hold scattered slots copies no state in or out. `usable(state)` says when it
applies (a float32 C-contiguous CPU state); the torch step serves every other case.
"""
from __future__ import annotations

import numpy as np
import torch

from vlbatch.operators.kernels.delta_rule.cpu_scan import scan_kernel, v_array


def usable(state: torch.Tensor) -> bool:
    """The compiled step reads and writes `state` [B, H, K, V] in place through numpy: CPU,
    float32, C-contiguous (a pool slice or a gathered copy is; a strided view is not)."""
    return state.device.type == "cpu" and state.dtype == torch.float32 and state.is_contiguous()


def warm_up() -> None:
    """Load (or, the first time on a machine, compile and cache) the compiled step: ~1 s
    that `select_delta_rule` spends at model load rather than on the first decode."""
    decode_step_cpu_(*(torch.zeros(1, 1, 1) for _ in range(3)), torch.zeros(1, 1), torch.zeros(1, 1),
                     torch.zeros(1, 1, 1, 1))  # the slot-indexed form is the same compiled kernel


def decode_step_cpu_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """One decode token per sequence: q, k [B, H, K], v [B, H, V], g, beta [B, H]; state
    [B, H, K, V] (`usable`) is overwritten with the state after the token. Returns o
    [B, H, V] in v's dtype."""
    return decode_step_slots_cpu_(q, k, v, g, beta, state, torch.arange(state.shape[0]))


def decode_step_slots_cpu_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """As `decode_step_cpu_` for the states pool[slots] (pool [S, H, K, V] `usable`, slots [B]
    distinct), updated in place in the pool: no gathered copy, no store back."""
    b, (h, dk, dv) = slots.shape[0], pool.shape[1:]

    def f32(x, *shape):  # small inputs: float32, contiguous, [B, H, *] (B sequences of one token)
        return x.detach().to(torch.float32).contiguous().view(b, h, *shape).numpy()

    out = torch.empty(b, h, dv, dtype=torch.float32)
    scan_kernel(f32(q, dk), f32(k, dk), v_array(v.reshape(b, h, dv)), f32(g), f32(beta), pool.detach().numpy(),
                 slots.to(torch.int64).contiguous().numpy(), np.arange(b + 1), out.numpy())
    return out.to(v.dtype)
