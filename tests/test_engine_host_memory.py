"""`host_memory.retain_freed_memory`: after it, a freed step-sized temporary's pages are reused
(no fresh page faults for the next one), which is what the CPU engine relies on."""
from __future__ import annotations

import platform
import resource
import statistics

import pytest
import torch

from vlbatch.operators.engine.host_memory import retain_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_temporaries_are_reused_without_page_faults():
    assert retain_freed_memory()
    torch.empty((18 << 20) // 4).fill_(1.0)  # first touch: the heap grows to hold it
    per_round = []
    # step temporaries of slightly different sizes (a [T, 1536] float32 projection, T ~ 3.3k-4.7k):
    # without the tuning each is above glibc's dynamic mmap threshold (the last freed size), so it is
    # mmap'd and faulted in whole (~5-7k pages); with it only the heap's growth is new (~256 pages)
    for mib in range(19, 29):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty((mib << 20) // 4).fill_(1.0)
        per_round.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert statistics.median(per_round) < (19 << 20) // 4096 // 4, per_round
