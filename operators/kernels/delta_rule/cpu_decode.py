"""The gated delta rule's decode step on the CPU as one compiled pass over the state (numba).

`decode_step_cpu_(q, k, v, g, beta, state)` is `chunked.recurrent_gated_delta_rule_` (the
torch step, its reference beside it; both are tested against `naive.NaiveDeltaRule`) with
the same algebra per (sequence, head):

    r_q = S^T q,  r_k = S^T k              one read of S [K, V] (16 KiB at K = V = 64: L1)
    d = beta (v - exp(g) r_k);  o = exp(g) r_q + (q . k) d
    S = exp(g) S + k d^T                   written while S is still in L1

so the state crosses memory once (read + write) instead of the three passes of the torch
step, and no [B, H, K, V] temporary exists. `decode_step_slots_cpu_` is the same kernel
reading and writing the states where the engine's pool keeps them (`pool[slots]`), so a step
whose sequences hold scattered slots copies no state in or out. `usable(state)` says when it
applies (a float32 C-contiguous CPU state); the torch step serves every other case.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit


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

    def flat(x, *shape):  # small inputs: float32, contiguous, [B * H, *]
        return x.detach().to(torch.float32).contiguous().view(b * h, *shape).numpy()

    out = torch.empty(b * h, dv, dtype=torch.float32)
    _step_kernel(flat(q, dk), flat(k, dk), flat(v, dv), flat(g), flat(beta), pool.detach().numpy(),
                 slots.to(torch.int64).contiguous().numpy(), out.numpy())
    return out.view(b, h, dv).to(v.dtype)


@njit(cache=True, nogil=True, boundscheck=False)
def _step_kernel(q, k, v, g, beta, pool, slots, out):  # pragma: no cover - compiled
    """q, k [N, K], v [N, V], g, beta [N] with N = B * H (row n: sequence n // H, head n % H);
    pool [S, H, K, V] (rows pool[slots[b], h] updated in place), slots [B]; out [N, V]; float32."""
    n_heads, dk, dv = pool.shape[1], pool.shape[2], pool.shape[3]
    r_q = np.empty(dv, np.float32)
    r_k = np.empty(dv, np.float32)
    delta = np.empty(dv, np.float32)
    d4 = dk - dk % 4
    for n in range(q.shape[0]):
        s = pool[slots[n // n_heads], n % n_heads]
        r_q[:] = 0.0
        r_k[:] = 0.0
        qk = np.float32(0.0)
        for i in range(0, d4, 4):  # four rows of S per pass over r_q / r_k (same summation order)
            q0, q1, q2, q3 = q[n, i], q[n, i + 1], q[n, i + 2], q[n, i + 3]
            k0, k1, k2, k3 = k[n, i], k[n, i + 1], k[n, i + 2], k[n, i + 3]
            qk = (((qk + q0 * k0) + q1 * k1) + q2 * k2) + q3 * k3
            for j in range(dv):
                s0, s1, s2, s3 = s[i, j], s[i + 1, j], s[i + 2, j], s[i + 3, j]
                r_q[j] = (((r_q[j] + s0 * q0) + s1 * q1) + s2 * q2) + s3 * q3
                r_k[j] = (((r_k[j] + s0 * k0) + s1 * k1) + s2 * k2) + s3 * k3
        for i in range(d4, dk):  # rows of S: the inner loop runs along V, contiguous (vectorised)
            qi, ki = q[n, i], k[n, i]
            qk += qi * ki
            for j in range(dv):
                r_q[j] += s[i, j] * qi
                r_k[j] += s[i, j] * ki
        a = np.exp(g[n])
        bt = beta[n]
        for j in range(dv):
            d = (v[n, j] - r_k[j] * a) * bt
            delta[j] = d
            out[n, j] = r_q[j] * a + qk * d
        for i in range(dk):
            ki = k[n, i]
            for j in range(dv):
                s[i, j] = s[i, j] * a + ki * delta[j]
