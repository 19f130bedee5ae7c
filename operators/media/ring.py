"""The decoder child's frame hand-off: a shared-memory ring the parent owns, sized and sealed.

Owns where decoded frames travel from the killable child (`vlbatch.operators.media.worker`) to
the parent: not through the pipe (two copies through the kernel, a syscall and often a context
switch per 64 KB), but through one anonymous shared-memory file (`memfd_create`) that the parent
creates, sizes and passes to each child it starts as an inherited file descriptor (no name, so
nothing in /dev/shm to leak, even if the parent is SIGKILLed).

Trust: the child parses untrusted media and may be compromised, so
- the parent creates the memory sealed against shrinking (`F_SEAL_SHRINK | F_SEAL_SEAL`): a child
  cannot truncate it under the parent's mapping (which would SIGBUS the parent on its next read);
- the parent decides the ring's size and where each frame lies (`ring_slots`, its own frame count),
  reads a frame only after checking its header against the validated plan, and copies it into its
  own array before it tells the child the slot is free: a returned clip never aliases the ring, so
  a child (this one or the next) cannot change frames the parent already returned;
- the child only writes frames into slots the parent has credited (flow control below).

Flow control (per plan, both sides compute `slots = ring_slots(frame_bytes, F)`): after a plan the
parent grows the ring to `slots x frame_bytes` and writes `slots` credit bytes on the request pipe;
the child takes one credit per frame it writes into slot `n % slots` (n: its frame count in this
plan), then sends the frame's header; the parent copies the slot out and writes one credit back.
Before its next plan, "done" or "error", the child takes every credit still owed (`slots + n` in
all), so the request pipe is empty between messages and the parent never reads a slot being written.

Memory: the ring holds at most `slots` frames: as many as fit in RING_BYTES, at least two (the
child decodes the next frame while the parent copies one), never more than the plan's frames, so
never above the plan's own `max_output_bytes`. The mapping is reused across videos and children;
pages above RING_BYTES are handed back after each video (`trim`), all of it on `close`.

Why a ring copied out of, and not zero-copy (a memfd per plan that the child writes and the parent seals
with F_SEAL_WRITE, then maps): built and measured in session 27, it cost 1.2 CPU s more than in-process
per 1.5 GB of frames (0.6 with huge pages off), the ring 0.17 (0.07): shmem's 4 KB pages cost more over
their life (allocation, LRU, mapping in two processes, eviction) than the one copy they save
(`python -m benchmarks.bench_frame_handoff`, AMD EPYC).
"""
from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from vlbatch.operators.errors import MediaError, SetupError

RING_BYTES = 16 << 20  # frames the ring holds beyond two: 13 of 480p, 2 of 1080p (6 MB each)
CREDIT = b"\x01"  # one slot freed (parent -> child, on the request pipe)


def ring_slots(frame_bytes: int, frames: int) -> int:
    """How many frames of `frame_bytes` the ring holds for a plan of `frames` (at least 1)."""
    return max(1, min(frames, max(2, RING_BYTES // max(frame_bytes, 1))))


def _pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages (at least one: a mapping is never empty)."""
    return max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE


class FrameRing:
    """Parent side: the sealed shared memory, grown on demand, mapped once per size. Not thread-safe."""

    def __init__(self):
        try:
            self.fd = os.memfd_create("vlbatch-decode-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError) as e:  # not Linux, or a sandbox (seccomp) that forbids it
            raise SetupError(f"the video decoder's frame ring needs Linux shared memory (memfd_create): {e}; "
                             "run on Linux and allow memfd_create in any sandbox around the workers") from None
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        except OSError as e:
            os.close(self.fd)
            raise SetupError(f"the video decoder's frame ring cannot be sealed (fcntl F_ADD_SEALS): {e}") from None
        self._map: mmap.mmap | None = None

    @property
    def mapped_bytes(self) -> int:
        return len(self._map) if self._map is not None else 0

    def reserve(self, nbytes: int) -> None:
        """Make at least `nbytes` mapped (grow the file, map it anew); never shrinks."""
        nbytes = _pages(nbytes)
        if nbytes <= self.mapped_bytes:
            return
        if self._map is not None:
            self._map.close()
            self._map = None
        try:
            if os.fstat(self.fd).st_size < nbytes:  # a child may have grown it; shrinking is sealed
                os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:  # out of memory or address space: this video's frames do not fit now
            raise MediaError(f"the decoder's frame ring cannot hold {nbytes} bytes: {e}") from None

    def copy_out(self, pos: int, out: np.ndarray) -> None:
        """Copy slot `pos` (of `out.nbytes` bytes each) into `out`, the parent's own array."""
        n = out.nbytes
        slot = np.frombuffer(self._map, np.uint8, count=n, offset=pos * n)
        np.copyto(out.reshape(-1), slot)
        del slot  # release the export, so the mapping can be replaced by the next `reserve`

    def trim(self) -> None:
        """Hand back the pages above RING_BYTES (a frame larger than the ring's share grew it)."""
        keep = _pages(RING_BYTES)
        if self.mapped_bytes > keep:
            self._map.madvise(mmap.MADV_REMOVE, keep, self.mapped_bytes - keep)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ChildRing:
    """Child side: the inherited ring fd, mapped as large as the parent has made it."""

    def __init__(self, fd: int):
        self.fd = fd
        self._map: mmap.mmap | None = None

    def slots(self, count: int, shape: tuple[int, ...]) -> np.ndarray:
        """The ring as `[count, *shape]` uint8 (writable), remapped if the parent grew it."""
        need = count * int(np.prod(shape))
        if self._map is None or len(self._map) < need:
            size = os.fstat(self.fd).st_size
            if size < need:
                raise RuntimeError(f"the frame ring holds {size} bytes, {need} needed")
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(self._map, np.uint8, count=need).reshape(count, *shape)
