"""The chunked gated delta rule over sequences of different lengths packed in one tensor.

`chunk_gated_delta_rule_packed(q, k, v, g, beta, state, lens)` runs B sequences whose
tokens are packed `[T, H, *]` in `lens` order, each from its own state `[B, H, K, V]`,
with the same per-chunk algebra as `delta_rule.chunk_gated_delta_rule` (its docstring
has the formulas). Every sequence is cut into chunks of C tokens (its last chunk
zero-padded: k = 0, beta = 0, g = 0 leave the state untouched), and all chunks of all
sequences run together. Sequences are ordered by chunk count (most first) and chunk i
of every sequence that has one sits in one contiguous block of the chunk batch
`[N, H, C, *]`; scan step i computes that block's intra-chunk terms in batches of `SEQ_BLOCK` sequences
(decay matrix, A^-1 by blocks (`unit_lower_inverse`), U and W as one matmul, Q K^T) and then updates
the leading rows of the state in place.

The reference is `delta_rule.chunk_gated_delta_rule` run on each sequence alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

EXP_FLOOR = -80.0  # exp(-80) ~ 1.8e-35: smaller decay factors are computed as this one
# Sequences per block of a scan step: the block's temporaries (~10 of [16, H, C, C or D])
# stay a few MB, which the allocator keeps and reuses instead of fresh pages each step.
SEQ_BLOCK = 16
# Diagonal blocks of A = I + strict_tril(...) solved directly by `unit_lower_inverse`; the
# rest of A^-1 is built from them by batched matmuls.
INV_BLOCK = 16


@dataclass(frozen=True)
class ChunkLayout:
    """Where each packed token goes in the chunk batch; built once per call (on the CPU)."""

    chunk: int  # C
    num_chunks: int  # N
    index: torch.Tensor  # [T * H] flat position of (token, head) in [N, H, C]
    order: torch.Tensor  # [B] sequences by chunk count, most first
    blocks: tuple[tuple[int, int], ...]  # scan step i: (first chunk, number of sequences)

    @classmethod
    def build(cls, lens: tuple[int, ...], heads: int, chunk_size: int, device) -> ChunkLayout:
        c = max(1, min(chunk_size, max(lens)))
        counts = [-(-n // c) for n in lens]
        order = sorted(range(len(lens)), key=lambda i: -counts[i])
        rank = {s: r for r, s in enumerate(order)}
        blocks, first = [], 0
        for i in range(counts[order[0]]):
            active = sum(1 for n in counts if n > i)
            blocks.append((first, active))
            first += active
        starts = [b[0] for b in blocks]
        lengths = torch.tensor(lens, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(len(lens)), lengths)  # [T]
        local = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        chunk_of = torch.tensor(starts, dtype=torch.long)[local // c] + torch.tensor(
            [rank[s] for s in range(len(lens))], dtype=torch.long)[seq]  # [T] chunk slot
        base = chunk_of * (heads * c) + local % c  # position of head 0
        index = (base[:, None] + torch.arange(heads) * c).view(-1)
        return cls(c, first, index.to(device), torch.tensor(order, device=device), tuple(blocks))


def _to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, H, D] or [T, H] -> float32 [N, H, C, D] or [N, H, C], zeros in the padding."""
    h = x.shape[1]
    tail = x.shape[2:]
    out = x.new_zeros(layout.num_chunks * h * layout.chunk, *tail, dtype=torch.float32)
    out.index_copy_(0, layout.index, x.reshape(-1, *tail).float())
    return out.view(layout.num_chunks, h, layout.chunk, *tail)


def chunk_gated_delta_rule_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, lens: tuple[int, ...], chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K], v [T, H, V], g, beta [T, H] packed in `lens` order; state [B, H, K, V].

    Returns (o [T, H, V] in v's dtype, new state [B, H, K, V] float32). `state` is not modified.
    """
    t, h, dk = q.shape
    dv = v.shape[-1]
    layout = ChunkLayout.build(tuple(lens), h, chunk_size, q.device)
    c = layout.chunk
    qc, kc, vc = (_to_chunks(x, layout) for x in (q, k, v))  # [N, H, C, *]
    gc, bc = _to_chunks(g, layout), _to_chunks(beta, layout)  # [N, H, C]

    cum = gc.cumsum(-1)  # G: [N, H, C]
    s = state.float().index_select(0, layout.order)  # [B, H, K, V] by chunk count (a copy)
    out = torch.empty(layout.num_chunks, h, c, dv, dtype=torch.float32, device=q.device)
    steps = [(first + j, j, min(SEQ_BLOCK, m - j)) for first, m in layout.blocks for j in range(0, m, SEQ_BLOCK)]
    for first, j, m in steps:  # scan step i, for sequences j .. j + m - 1 of those with a chunk i
        sl, cur = slice(first, first + m), s[j: j + m]
        u, w, attn, q_read, k_write, chunk_decay = _intra(qc[sl], kc[sl], vc[sl], bc[sl], cum[sl])
        delta = torch.baddbmm(u.flatten(0, 1), w.flatten(0, 1), cur.flatten(0, 1), alpha=-1).view(m, h, c, dv)
        torch.matmul(q_read, cur, out=out[sl])
        out[sl].view(m * h, c, dv).baddbmm_(attn.flatten(0, 1), delta.flatten(0, 1))
        cur.mul_(chunk_decay).view(m * h, dk, dv).baddbmm_(k_write.flatten(0, 1), delta.flatten(0, 1))
    new_state = torch.empty_like(s)
    new_state[layout.order] = s
    o = out.view(-1, dv).index_select(0, layout.index).view(t, h, dv)
    return o.to(v.dtype), new_state


def _intra(qc, kc, vc, bc, cum):
    """Intra-chunk terms of a block of chunks [M, H, C, *] (the scan step's own chunks, so
    these temporaries stay small and cache-warm): U, W, masked Q K^T, Q exp(G),
    (K exp(G_C - G))^T and exp(G_C)."""
    dv = vc.shape[-1]
    # R = exp(G_i - G_j) on and below the diagonal, 0 above. The exponent is clamped at
    # EXP_FLOOR (R < 1e-34 is noise next to the other terms) and at 0 above the diagonal
    # before tril: exp of huge negative or positive values (underflow, -inf) is ~10x slower.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).clamp_(EXP_FLOOR, 0.0).exp_().tril_()
    k_beta = kc * bc.unsqueeze(-1)
    system = (k_beta @ kc.transpose(-1, -2)).mul_(decay).tril_(-1)  # strict part of A
    # U and W in one matmul: A^-1 [beta V | beta exp(G) K], the right-hand sides side by side
    rhs = torch.empty(*vc.shape[:-1], dv + kc.shape[-1], dtype=vc.dtype, device=vc.device)
    torch.mul(vc, bc.unsqueeze(-1), out=rhs[..., :dv])
    growth = cum.exp().unsqueeze(-1)  # exp(G) [M, H, C, 1], for W and the state read
    torch.mul(k_beta, growth, out=rhs[..., dv:])
    u, w = (unit_lower_inverse(system) @ rhs).split([dv, kc.shape[-1]], dim=-1)  # U [.., C, V], W [.., C, K]
    attn = (qc @ kc.transpose(-1, -2)).mul_(decay)  # [M, H, C, C]
    q_read = qc * growth
    k_write = (kc * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)  # [M, H, K, C]
    return u, w, attn, q_read, k_write, cum[..., -1].exp()[..., None, None]


def unit_lower_inverse(strict: torch.Tensor, block: int = INV_BLOCK) -> torch.Tensor:
    """(I + strict)^-1 for `strict` [.., C, C] strictly lower triangular (what is above the
    diagonal is never read, the diagonal is taken as 1); returns [.., C, C], 0 above it.

    By blocks: the diagonal `block` x `block` blocks by one batched triangular solve, then
    doubling (block, 2 block, ...): with both diagonal halves of a 2s x 2s block inverted,
    its lower-left s x s block is -T22 A21 T11 (two batched matmuls). ~2.5x faster on the
    CPU than one solve of the whole C x C system (at C = 64), same accuracy. C not of the
    form block * 2^n: one solve (`unit_lower_inverse_naive`, the reference).
    """
    c = strict.shape[-1]
    n = c // block
    if c <= block or c % block or n & (n - 1):
        return unit_lower_inverse_naive(strict)
    a = strict.reshape(-1, c, c)
    m = a.shape[0]
    inv = torch.zeros_like(a)

    def blocks(x, size, offset):  # [M, P, size, size]: one of the four blocks of each 2*size diagonal block
        return x.as_strided((m, c // (2 * size), size, size), (c * c, 2 * size * (c + 1), c, 1), offset)

    diagonal = a.as_strided((m, n, block, block), (c * c, block * (c + 1), c, 1))
    eye = torch.eye(block, dtype=a.dtype, device=a.device).expand_as(diagonal)
    inv.as_strided(diagonal.shape, diagonal.stride()).copy_(
        torch.linalg.solve_triangular(diagonal, eye, upper=False, unitriangular=True))
    size = block
    while size < c:
        t11, t22 = blocks(inv, size, 0), blocks(inv, size, size * (c + 1))
        blocks(inv, size, size * c).copy_((t22 @ (blocks(a, size, size * c) @ t11)).neg_())
        size *= 2
    return inv.view(strict.shape)


def unit_lower_inverse_naive(strict: torch.Tensor) -> torch.Tensor:
    """(I + strict)^-1 by one triangular solve against the identity: the reference."""
    eye = torch.eye(strict.shape[-1], dtype=strict.dtype, device=strict.device).expand_as(strict)
    return torch.linalg.solve_triangular(strict, eye, upper=False, unitriangular=True)
