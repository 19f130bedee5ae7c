"""Host heap tuning for engines on the CPU: freed step temporaries stay in the process.

A CPU step allocates and frees tens of MB of temporaries per layer (a [T, 1536] float32
projection at T = 4096 packed tokens is 25 MB). With glibc's defaults such blocks go back
to the OS when freed (mmap'd above a threshold that starts at 128 KiB; the heap top
trimmed past 128 KiB), so the next layer faults the same pages in again, zeroed by the
kernel: in `bench_engine` (a) ~600k page faults, ~1.2 s of system time of a ~10 s run, and
the caches it evicts. `retain_freed_memory` raises both thresholds (`mallopt`): blocks up
to `MMAP_THRESHOLD` come from the heap, and up to `TRIM_THRESHOLD` of free heap top stays
mapped, so later steps reuse warm pages (~60k faults).

Process-wide, as malloc's parameters are (whatever else runs in the process keeps its
freed memory too; peak RSS is unchanged, the resident set just does not shrink between
steps); idempotent. Where libc is not glibc, nothing is changed. Because it changes the
whole process, a library constructor must not call it: the process owner does (the
pipeline's model actor, `pipeline/stages/model_stage.py`, when the model runs on the CPU;
`benchmarks/bench_engine.py` at the start of its process, for both contenders alike).
An embedding application that wants it calls it once itself.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 512 << 20


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True when both were accepted."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
