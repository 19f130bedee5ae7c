"""What it costs to hand a video's frames from the decoder child to the parent, per way, per GB of frames.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_frame_handoff [--frames 1200 --height 480 --width 854] [--rounds 7]

The decoder child (`operators/media/worker.py`) must give the parent frames the child can no longer
change. Three ways, each timed (CPU s) as one process doing both sides, in rounds whose order alternates,
medians and ranges printed, with transparent huge pages on (as numpy asks for them) and off:
- in-process: the reference. A fresh output array, each frame copied in from a decoder-sized buffer;
- ring (what `DecodeWorker` does, `operators/media/ring.py`): each frame copied into a warm 16 MB ring
  (the child), then out into a fresh output array (the parent): in-process + one warm copy;
- memfd: no copy after the decoder's: a shared-memory file of exactly the frames, populated and written
  (the child), unmapped, sealed against writing, mapped privately and read once (the parent), then freed.
Why it exists: session 27 built the memfd hand-off (zero-copy) and measured it slower than the ring by
about 1 CPU s per 1.5 GB: shmem's 4 KB pages cost more over their life (allocation, LRU, mapping in two
processes, eviction) than the one memcpy they save. This keeps that decision measurable.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import mmap
import os
import statistics
import time

import numpy as np

from vlbatch.operators.media.ring import ring_slots


def in_process(src: np.ndarray, frames: int) -> None:
    out = np.empty((frames, src.shape[1]), np.uint8)
    for i in range(frames):
        out[i] = src[i % len(src)]


def ring(src: np.ndarray, frames: int, slots: np.ndarray) -> None:
    out = np.empty((frames, src.shape[1]), np.uint8)
    for i in range(frames):
        slot = slots[i % len(slots)]
        slot[:] = src[i % len(src)]  # the child's copy into the ring
        out[i] = slot  # the parent's copy out


def memfd(src: np.ndarray, frames: int) -> None:
    nbytes = frames * src.shape[1]
    fd = os.memfd_create("bench-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        child = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        rows = np.frombuffer(child, np.uint8).reshape(frames, -1)
        for i in range(frames):
            rows[i] = src[i % len(src)]
        del rows
        child.close()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        parent = mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        view = np.frombuffer(parent, np.uint8)
        int(view[::4096].sum())  # the caller's first read maps every page in
        del view
        parent.close()
    finally:
        os.close(fd)


def measure(frames: int, frame_bytes: int, rounds: int) -> dict[str, list[float]]:
    src = np.random.default_rng(0).integers(0, 255, (8, frame_bytes), np.uint8)  # a decoder's chunk
    slots = np.ones((ring_slots(frame_bytes, frames), frame_bytes), np.uint8)  # warm, sized as the worker's
    ways = {"in-process": lambda: in_process(src, frames), "ring": lambda: ring(src, frames, slots),
            "memfd": lambda: memfd(src, frames)}
    spent: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            cpu = time.process_time()
            ways[name]()
            spent[name].append(time.process_time() - cpu)
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=1200)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=854)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    frame_bytes = a.height * a.width * 3
    gb = a.frames * frame_bytes / 1e9
    print(f"frame hand-off: {a.frames} frames of {a.width}x{a.height} ({gb:.2f} GB), CPU s, medians of {a.rounds} "
          "rounds [range]")
    for thp in (True, False):
        if not thp and ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) != 0:  # PR_SET_THP_DISABLE
            print("huge pages off: prctl refused; skipped")
            break
        spent = measure(a.frames, frame_bytes, a.rounds)
        base = statistics.median(spent["in-process"])
        parts = [f"{name} {statistics.median(v):.3f} [{min(v):.2f}-{max(v):.2f}] ({statistics.median(v) - base:+.3f})"
                 for name, v in spent.items()]
        print(f"huge pages {'on ' if thp else 'off'}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
