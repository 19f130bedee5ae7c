"""DeltaNet state slots for running sequences, and snapshots for the prefix cache.

Every Gated DeltaNet layer carries, per sequence, a conv state `[C, K]` (last K conv
inputs, model dtype) and a recurrent state `[H_v, D_k, D_v]` (float32). The pool holds
them for up to `num_slots` running sequences:

    conv       [n_linear, num_slots, C, K]
    recurrent  [n_linear, num_slots, H_v, D_k, D_v]

A `Snapshot` is a copy of one slot's states across all linear layers taken at an exact
token position; the prefix cache keeps it at a branch point and `restore` writes it into
the slot of a sequence that resumes from there. Snapshots are copies, never views, so a
sequence that continues from a restored slot cannot alter the cached snapshot
(copy-on-write isolation by construction).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlbatch.operators.errors import ConfigError


@dataclass(frozen=True)
class Snapshot:
    """States of all linear layers at one position: conv [n_linear, C, K], recurrent [n_linear, H, Dk, Dv]."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()


class StatePool:
    """Fixed pool of DeltaNet state slots; slot ids are handed out and returned."""

    def __init__(self, num_slots: int, num_linear: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                 k_dim: int, v_dim: int, *, dtype: torch.dtype = torch.float32, device="cpu", scratch: bool = False):
        """`scratch`: one more slot, `scratch_slot`, never handed out: the padded rows of a
        static decode step read and write it."""
        if num_slots < 1:
            raise ConfigError(f"the state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots if scratch else None
        total = num_slots + int(scratch)
        self.conv = torch.zeros(num_linear, total, conv_dim, conv_kernel, dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_linear, total, num_v_heads, k_dim, v_dim, dtype=torch.float32,
                                     device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one sequence's states (all linear layers, conv + recurrent)."""
        c = self.conv[:, 0]
        r = self.recurrent[:, 0]
        return c.numel() * c.element_size() + r.numel() * r.element_size()

    def allocate(self) -> int:
        """A zeroed slot (the state before any token). Raises MemoryError when none is free."""
        if not self._free:
            raise MemoryError("no free DeltaNet state slot")
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"slot {slot} freed twice")
        self._free.append(slot)

    def snapshot(self, slot: int) -> Snapshot:
        """Copy slot `slot`'s states out (the copy shares no memory with the pool)."""
        return Snapshot(self.conv[:, slot].clone(), self.recurrent[:, slot].clone())

    def restore(self, slot: int, snap: Snapshot) -> None:
        """Overwrite slot `slot` with a snapshot (the snapshot itself is left unchanged)."""
        self.conv[:, slot].copy_(snap.conv)
        self.recurrent[:, slot].copy_(snap.recurrent)

    # -- the StepCache side: gather / scatter a step's slots ---------------------------------
    @staticmethod
    def contiguous_run(slots: list[int]) -> tuple[int, int] | None:
        """(first, count) when `slots` are consecutive ascending ids (then views replace copies);
        host ints, so deciding never waits on the device."""
        n = len(slots)
        if n and all(b - a == 1 for a, b in zip(slots, slots[1:], strict=False)):
            return slots[0], n
        return None

    def gather(self, linear_idx: int, slots: torch.Tensor, run: tuple[int, int] | None = None):
        """(conv [B, C, K], recurrent [B, H, Dk, Dv]) of `slots` [B].

        `run` = `contiguous_run(slots)` (computed once per step): views instead of copies,
        so a decode step that updates the recurrent states in place writes the pool
        directly; otherwise copies, which `scatter` writes back.
        """
        if run is not None:
            return self.conv[linear_idx].narrow(0, *run), self.recurrent[linear_idx].narrow(0, *run)
        return self.conv[linear_idx].index_select(0, slots), self.recurrent[linear_idx].index_select(0, slots)

    def scatter(self, linear_idx: int, slots: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor,
                run: tuple[int, int] | None = None) -> None:
        """Store the states of `slots` after a step. A state the model updated in place in
        the views `gather` handed out is already stored (nothing is copied)."""
        if run is not None:
            for pool, new in ((self.conv[linear_idx], conv), (self.recurrent[linear_idx], recurrent)):
                dst = pool.narrow(0, *run)
                if not _same_memory(dst, new):
                    dst.copy_(new)
            return
        self.conv[linear_idx].index_copy_(0, slots, conv.to(self.conv.dtype))
        self.recurrent[linear_idx].index_copy_(0, slots, recurrent.to(torch.float32))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
