"""`host_memory.retain_freed_memory`: after it, a freed step-sized temporary's pages are reused
(no fresh page faults for the next one), which is what the CPU engine relies on."""
from __future__ import annotations

import platform
import resource

import pytest
import torch

from vlbatch.operators.engine.host_memory import retain_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_temporaries_are_reused_without_page_faults():
    assert retain_freed_memory()
    nbytes = 24 << 20  # a [4096, 1536] float32 projection: above glibc's default mmap threshold
    for _ in range(2):  # first touches: the heap grows to hold it (and the trim threshold settles)
        torch.empty(nbytes // 4).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.empty(nbytes // 4).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # without the tuning every round faults all ~6000 pages in again (~24k faults)
    assert faults < (nbytes // 4096) // 2, faults
