"""Where requests known in advance branch off each other (offline planning).

For a set of prompts (as prefix-cache keys), the branch points of prompt r are the
positions 0 < p < L_r at which r stops sharing its prefix with some other prompt:
{LCP(r, s) : s != r} — the ends of the compressed-trie nodes on r's path. Typical ones:
end of the shared system prompt, end of a shared image's placeholders, end of a shared
instruction. The scheduler cuts prefill chunks there so DeltaNet states are snapshotted
at exactly those positions, and holds siblings back until the first one has inserted it.

Computed from the lexicographically sorted keys: LCP(r, s) is the minimum of adjacent
LCPs between them, so the distinct values for r are the running minima to each side,
kept by a monotonic stack in one sweep each way (O(N * depth) instead of O(N^2)).
"""
from __future__ import annotations

import hashlib

import numpy as np


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading keys `a` [La] and `b` [Lb] share (the radix tree's edge walk uses it too)."""
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def plan_branch_points(keys: list[np.ndarray]) -> list[tuple[int, ...]]:
    """Sorted branch points of each prompt (same order as `keys`)."""
    n = len(keys)
    order = sorted(range(n), key=lambda i: keys[i].tolist())
    adj = [common_prefix_len(keys[order[i - 1]], keys[order[i]]) for i in range(1, n)]  # adj[i-1] between i-1, i
    points: list[set[int]] = [set() for _ in range(n)]
    for direction in (1, -1):
        stack: list[int] = []  # increasing running minima seen from the current element
        idx = range(1, n) if direction == 1 else range(n - 2, -1, -1)
        for i in idx:
            h = adj[i - 1] if direction == 1 else adj[i]
            while stack and stack[-1] >= h:
                stack.pop()
            stack.append(h)
            points[order[i]].update(stack)
    out = []
    for i, pts in enumerate(points):
        L = len(keys[i])
        out.append(tuple(sorted(p for p in pts if 0 < p < L)))
    return out


def plan_branch_points_naive(keys: list[np.ndarray]) -> list[tuple[int, ...]]:
    """Reference: all pairs."""
    out = []
    for i, a in enumerate(keys):
        pts = {common_prefix_len(a, b) for j, b in enumerate(keys) if j != i}
        out.append(tuple(sorted(p for p in pts if 0 < p < len(a))))
    return out


def prefix_digest(keys: np.ndarray, length: int) -> bytes:
    """Identity of the prefix keys[:length] for sibling gating (only a scheduling hint)."""
    return hashlib.blake2b(keys[:length].tobytes(), digest_size=16).digest()
