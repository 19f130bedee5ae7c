"""The causal depthwise conv1d's decode step and packed prefill on the CPU as compiled loops (numba).

Same contracts (and state convention) as `conv.causal_conv1d_step` / `conv.causal_conv1d_packed`,
whose torch forms stay beside them as the twins (both are tested against
`conv.causal_conv1d_naive`). The torch forms make several passes over [T, C] (a
buffer of state + inputs, K shifted multiply-adds, index selects; at decode a cat, a
batched matmul and the SiLU), each a fresh tensor; here every output element is one
K-term sum in registers, read straight from the input rows or the state:

    out[t, c] = silu(sum_j w[c, j] * x[t - K + 1 + j, c])   (rows before the sequence from its state)

summed in the same order (j = 0 .. K - 1) as the torch forms; the SiLU is torch's, in
place (vectorised; a scalar exp per element in the loop would cost more than the conv). `usable(...)` says when they
apply (CPU float32); the torch forms serve every other case.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from vlbatch.operators.model.ops.cpu import cpu_float32

usable = cpu_float32  # CPU float32 tensors, any strides (the kernels read numpy views)


def warm_up() -> None:
    """Load (or, the first time on a machine, compile and cache) both kernels at model load, for
    each array layout the decoder passes: the step's x is a strided view of the fused
    projection when B > 1 (numba layout 'A') and contiguous at B = 1 ('C')."""
    state, weight = torch.zeros(2, 3, 2), torch.zeros(3, 2)
    for x in (torch.zeros(2, 3), torch.zeros(2, 6)[:, :3]):
        conv1d_step_cpu(x, weight, state)
        conv1d_step_slots_cpu(x, weight, state, torch.tensor([1, 0]))
    conv1d_packed_cpu(torch.zeros(2, 3), weight, state[:1], (2,))


def conv1d_step_cpu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                    inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C], weight [C, K], conv_state [B, C, K] -> (silu(conv) [B, C], new conv_state [B, C, K]).
    `inplace` (a C-contiguous state): the new state is written over `conv_state`, which is returned
    (the kernel shifts each row left before writing the new input, reading every value first)."""
    b, c = x.shape
    k = weight.shape[-1]
    out = torch.empty(b, c, dtype=torch.float32)
    inplace = inplace and conv_state.is_contiguous()
    new_state = conv_state if inplace else torch.empty(b, c, k, dtype=torch.float32)
    _step_kernel(x.detach().numpy(), weight.detach().numpy(), conv_state.detach().numpy(), out.numpy(),
                 new_state.numpy())
    return F.silu(out, inplace=True), new_state


def conv1d_step_slots_cpu(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
    """As `conv1d_step_cpu` in place for the states pool[slots] (pool [S, C, K] float32
    C-contiguous, slots [B] distinct) -> silu(conv) [B, C]: the engine's decode step when its
    sequences' slots are scattered (no gathered copy, no store back)."""
    b, c = x.shape
    out = torch.empty(b, c, dtype=torch.float32)
    _slots_kernel(x.detach().numpy(), weight.detach().numpy(), pool.detach().numpy(),
                  slots.to(torch.int64).contiguous().numpy(), out.numpy())
    return F.silu(out, inplace=True)


def conv1d_packed_cpu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      lens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of `lens` tokens packed in x [T, C], weight [C, K], conv_state [B, C, K]
    -> (silu(conv) [T, C], new conv_state [B, C, K])."""
    t, c = x.shape
    b, _, k = conv_state.shape
    out = torch.empty(t, c, dtype=torch.float32)
    new_state = torch.empty(b, c, k, dtype=torch.float32)
    if x.stride(1) != 1:
        x = x.contiguous()
    flat = x.detach().as_strided(((t - 1) * x.stride(0) + c,), (1,)).numpy() if t else x.detach().reshape(-1).numpy()
    _packed_kernel(flat, x.stride(0), c, weight.detach().t().contiguous().numpy(), conv_state.detach().numpy(),
                   np.asarray(lens, dtype=np.int64), out.numpy(), new_state.numpy())
    return F.silu(out, inplace=True), new_state


@njit(cache=True, nogil=True, boundscheck=False)
def _step_kernel(x, w, state, out, new_state):  # pragma: no cover - compiled
    """x [B, C], w [C, K], state [B, C, K] -> out [B, C] (before the SiLU), new_state [B, C, K]
    (may be `state` itself)."""
    for b in range(x.shape[0]):
        _step_row(x[b], w, state[b], new_state[b], out[b])


@njit(cache=True, nogil=True, boundscheck=False)
def _slots_kernel(x, w, pool, slots, out):  # pragma: no cover - compiled
    """x [B, C], w [C, K], pool [S, C, K] (rows pool[slots[b]] shifted in place) -> out [B, C]
    (before the SiLU)."""
    for b in range(x.shape[0]):
        state = pool[slots[b]]
        _step_row(x[b], w, state, state, out[b])


@njit(cache=True, nogil=True, boundscheck=False)
def _step_row(x, w, src, dst, out):  # pragma: no cover - compiled
    """One sequence: x [C], w [C, K], src -> dst [C, K] (may be the same array: every value is
    read before it is overwritten), out [C] = sum_j w[c, j] * input j, summed j = 0 .. K - 1."""
    n_c, k = w.shape
    if k == 4:  # Qwen3.5's kernel size, unrolled: the four reads before the writes, ~2x the loop below
        for c in range(n_c):
            s1, s2, s3, v = src[c, 1], src[c, 2], src[c, 3], x[c]
            acc = np.float32(0.0)
            acc += w[c, 0] * s1
            acc += w[c, 1] * s2
            acc += w[c, 2] * s3
            acc += w[c, 3] * v
            dst[c, 0], dst[c, 1], dst[c, 2], dst[c, 3] = s1, s2, s3, v
            out[c] = acc
        return
    for c in range(n_c):
        acc = np.float32(0.0)
        for j in range(k - 1):
            v = src[c, j + 1]
            dst[c, j] = v
            acc += w[c, j] * v
        v = x[c]
        dst[c, k - 1] = v
        acc += w[c, k - 1] * v
        out[c] = acc


@njit(cache=True, nogil=True, boundscheck=False)
def _packed_kernel(x, row_stride, n_c, wt, state, lens, out, new_state):  # pragma: no cover - compiled
    """x: the rows of x [T, C] as one flat array (row t at t * row_stride: contiguous, so the
    loops along C vectorise), wt [K, C] (the weight transposed), state [B, C, K], lens [B]
    -> out [T, C] (before the SiLU), new_state [B, C, K] (float32)."""
    k = wt.shape[0]
    r0 = 0
    for s in range(lens.shape[0]):
        n = lens[s]
        for t in range(n):
            row = out[r0 + t]
            if k == 4 and t >= 3:  # Qwen3.5's kernel size, every tap inside the sequence: one pass, same order
                _four_taps(x, (r0 + t - 3) * row_stride, row_stride, wt, row)
                continue
            for j in range(k):
                p = t - k + 1 + j  # input position read by tap j (< 0: from the state)
                w = wt[j]
                if p >= 0:
                    src = x[(r0 + p) * row_stride: (r0 + p) * row_stride + n_c]
                    for c in range(n_c):  # (`row[:] = w * src` would allocate a temporary per row)
                        row[c] = w[c] * src[c] if j == 0 else row[c] + w[c] * src[c]
                else:
                    for c in range(n_c):
                        row[c] = w[c] * state[s, c, k + p] if j == 0 else row[c] + w[c] * state[s, c, k + p]
        for i in range(k):  # the new state: the last K inputs, reaching into the old state when n < K
            p = n - k + i
            for c in range(n_c):
                new_state[s, c, i] = x[(r0 + p) * row_stride + c] if p >= 0 else state[s, c, k + p]
        r0 += n


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _four_taps(x, base, row_stride, wt, row):  # pragma: no cover - compiled
    """row [C] = sum_j wt[j] * x[base + j * row_stride + c], j = 0 .. 3 in order: one pass over
    the output row (the tap-by-tap loop above makes four; ~2x slower at C = 1024)."""
    n_c = row.shape[0]
    x0, x1 = x[base: base + n_c], x[base + row_stride: base + row_stride + n_c]
    x2 = x[base + 2 * row_stride: base + 2 * row_stride + n_c]
    x3 = x[base + 3 * row_stride: base + 3 * row_stride + n_c]
    w0, w1, w2, w3 = wt[0], wt[1], wt[2], wt[3]
    for c in range(n_c):
        acc = w0[c] * x0[c]
        acc += w1[c] * x1[c]
        acc += w2[c] * x2[c]
        acc += w3[c] * x3[c]
        row[c] = acc
