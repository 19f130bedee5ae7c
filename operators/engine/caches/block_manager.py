"""Paged KV bookkeeping for the full-attention layers: fixed-size blocks, reference counts.

Owns only block *ids*; the tensors live in the model runner (`[n_attn, 2, num_blocks,
block_size, H_kv, D]`). A sequence's block table lists the block holding each run of
`block_size` positions: position `p` lives in block `table[p // block_size]` at offset
`p % block_size`. A block may be referenced by several sequences and by prefix-cache nodes
at once (reference counts); it returns to the free list when the last reference goes.

Sharing rule (enforced by the callers, tested in tests/test_engine_prefix_cache.py): a
block is written only at positions at or beyond the writer's own computed length, and a
shared block is shared only for positions every sharer has computed identically, so a
full shared block is never written again and a partially valid one is copied first.
"""
from __future__ import annotations

from collections import deque

from vlbatch.operators.errors import ConfigError


def kv_bytes_per_block(block_size: int, num_attn_layers: int, num_kv_heads: int, head_dim: int,
                       elem_bytes: int) -> int:
    """Bytes of K and V for one block across every full-attention layer."""
    return 2 * block_size * num_attn_layers * num_kv_heads * head_dim * elem_bytes


def blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many whole blocks a byte budget holds (a budget below one block is an error)."""
    n = int(budget_bytes) // block_bytes
    if n < 1:
        raise ConfigError(f"kv_budget_bytes={budget_bytes} is below one KV block ({block_bytes} bytes)")
    return n


class BlockManager:
    """Free list plus per-block reference counts over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold positions [0, num_tokens)."""
        return -(-num_tokens // self.block_size)

    # -- mutation ------------------------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """Take `n` fresh blocks (reference count 1). Raises MemoryError if fewer are free."""
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks requested, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def incref(self, blocks) -> None:
        for b in blocks:
            if self._ref[b] < 1:
                raise RuntimeError(f"incref of free block {b}")
            self._ref[b] += 1

    def decref(self, blocks) -> None:
        """Drop one reference from each block; blocks reaching zero become free."""
        for b in blocks:
            if self._ref[b] < 1:
                raise RuntimeError(f"decref of free block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def grow_table(self, table: list[int], num_tokens: int) -> list[int]:
        """Append fresh blocks to `table` until it covers positions [0, num_tokens).

        Returns the new blocks (empty if none were needed). Raises MemoryError (table
        unchanged) if not enough blocks are free.
        """
        need = self.blocks_needed(num_tokens) - len(table)
        if need <= 0:
            return []
        new = self.allocate(need)
        table.extend(new)
        return new
