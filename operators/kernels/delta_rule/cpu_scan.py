"""The packed prefill of the gated delta rule on the CPU as one compiled token scan (numba).

`prefill_scan_cpu(q, k, v, g, beta, state, lens)` is the `DeltaRuleKernels.prefill` contract
(packed `[T, H, *]` in `lens` order, per-sequence states `[B, H, K, V]`, `state` left intact)
computed per (sequence, head) token by token with the decode step's algebra (`cpu_decode.py`
runs this same kernel, one token per sequence, on the pool's rows):

    r_q = S^T q,  r_k = S^T k;  d = beta (v - exp(g) r_k);  o = exp(g) r_q + (q . k) d
    S = exp(g) S + k d^T

The state [K, V] of one (sequence, head) stays in L1 across its tokens, so the rule costs
~3 K V multiply-adds per token and head with no chunk padding, no [C, C] blocks and no small
batched GEMMs (what the chunked form spends its time on where those are slow). One of the
forms `tuning.py` times on each machine; tested against the naive loop on odd shapes.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit


def usable(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def prefill_scan_cpu(q, k, v, g, beta, state, lens) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K], v [T, H, V], g, beta [T, H]; state [B, H, K, V] (not modified) ->
    (o [T, H, V] in v's dtype, new state [B, H, K, V] float32)."""
    t, h, dk = q.shape
    dv = v.shape[-1]

    def f32(x):
        return x.detach().to(torch.float32).contiguous().numpy()

    new_state = state.detach().to(torch.float32).clone().contiguous()
    out = torch.empty(t, h, dv, dtype=torch.float32)
    starts = np.zeros(len(lens) + 1, np.int64)
    starts[1:] = np.cumsum(np.asarray(lens, np.int64))
    scan_kernel(f32(q), f32(k), v_array(v), f32(g), f32(beta), new_state.numpy(), np.arange(len(lens)), starts,
                 out.numpy())
    return out.to(v.dtype), new_state


def v_array(v: torch.Tensor) -> np.ndarray:
    """v [..., V] as the kernel reads it: float32, any row strides (the layer's v is a column
    view of the conv output [T, C]: a copy of it was ~35 ms of bench (a)'s prefill steps)."""
    v = v.detach().to(torch.float32)
    return (v if v.stride(-1) == 1 else v.contiguous()).numpy()


def warm_up() -> None:
    """Load (or compile and cache, the first time on a machine) the kernel at model load, for
    both layouts of v it is given: contiguous, and a strided view (the layer's)."""
    z = torch.zeros(2, 1, 1)
    for v in (z, torch.zeros(2, 1, 2)[..., :1]):  # a size-1 view would count as contiguous
        prefill_scan_cpu(z, z, v, torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(1, 1, 1, 1), (2,))


@njit(cache=True, nogil=True, boundscheck=False)
def scan_kernel(q, k, v, g, beta, pool, slots, starts, out):  # pragma: no cover - compiled
    """q, k [T, H, K], v [T, H, V], g, beta [T, H]; pool [S, H, K, V] (rows pool[slots[b]]
    advanced in place), slots [B], starts [B + 1] (sequence b's tokens: starts[b] ..
    starts[b + 1] - 1), out [T, H, V]; float32. The decode step is its one-token case."""
    n_heads, dk, dv = pool.shape[1], pool.shape[2], pool.shape[3]
    r_q = np.empty(dv, np.float32)
    r_k = np.empty(dv, np.float32)
    delta = np.empty(dv, np.float32)
    d4 = dk - dk % 4
    for b in range(slots.shape[0]):
        for hh in range(n_heads):
            s = pool[slots[b], hh]
            for t in range(starts[b], starts[b + 1]):
                r_q[:] = 0.0
                r_k[:] = 0.0
                qk = np.float32(0.0)
                for i in range(0, d4, 4):  # four rows of S per pass over r_q / r_k (same summation order)
                    q0, q1, q2, q3 = q[t, hh, i], q[t, hh, i + 1], q[t, hh, i + 2], q[t, hh, i + 3]
                    k0, k1, k2, k3 = k[t, hh, i], k[t, hh, i + 1], k[t, hh, i + 2], k[t, hh, i + 3]
                    qk = (((qk + q0 * k0) + q1 * k1) + q2 * k2) + q3 * k3
                    for j in range(dv):
                        s0, s1, s2, s3 = s[i, j], s[i + 1, j], s[i + 2, j], s[i + 3, j]
                        r_q[j] = (((r_q[j] + s0 * q0) + s1 * q1) + s2 * q2) + s3 * q3
                        r_k[j] = (((r_k[j] + s0 * k0) + s1 * k1) + s2 * k2) + s3 * k3
                for i in range(d4, dk):  # rows of S: the inner loop runs along V, contiguous (vectorised)
                    qi, ki = q[t, hh, i], k[t, hh, i]
                    qk += qi * ki
                    for j in range(dv):
                        r_q[j] += s[i, j] * qi
                        r_k[j] += s[i, j] * ki
                a = np.exp(g[t, hh])
                bt = beta[t, hh]
                for j in range(dv):
                    d = (v[t, hh, j] - r_k[j] * a) * bt
                    delta[j] = d
                    out[t, hh, j] = r_q[j] * a + qk * d
                for i in range(dk):
                    ki = k[t, hh, i]
                    for j in range(dv):
                        s[i, j] = s[i, j] * a + ki * delta[j]
