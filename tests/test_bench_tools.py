"""The CPU profiling tools of benchmarks/ run and report what they say they do (small sizes;
the figures themselves are for people, not asserted)."""
from __future__ import annotations

import os
import time

import pytest

from benchmarks import profile_decode
from benchmarks.startup_cpu import StartupCpu


@pytest.mark.usefixtures("one_torch_thread")
def test_profile_decode_splits_a_decode_step(capsys):
    profile_decode.main(["--seqs", "3", "--prompt", "12", "--steps", "2", "--top", "200"])
    out = capsys.readouterr().out
    assert "decode step, 3 sequences (prompts 12 tokens)" in out
    assert "matmuls" in out and "compiled: delta_rule/cpu_scan.scan_kernel" in out
    assert "compiled: attention/cpu_decode._kernel" in out
    assert "host outside the forward: " in out and " us per sequence" in out


@pytest.mark.usefixtures("one_torch_thread")
def test_profile_decode_static_times_the_host_around_the_forward(capsys):
    profile_decode.main(["--seqs", "3", "--prompt", "12", "--steps", "2", "--top", "5", "--static"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "host outside the forward" in ln)
    host_ms = float(line.split(": ")[1].split(" ms")[0])
    assert "(static decode)" in line and host_ms > 0


def test_startup_cpu_counts_this_process_from_its_start():
    with StartupCpu(every_s=0.05) as probe:
        end = time.process_time() + 0.3
        while time.process_time() < end:  # 0.3 CPU s in this process inside the window
            pass
        window = time.time() - probe.start
    mine = probe.cpu_between(os.getpid(), probe.start, probe.start + window)
    assert 0.2 <= mine <= window + 0.1, mine
    report = probe.report(window)
    assert "CPU s used of" in report and "python" in report.lower()
    assert probe.report(None) == "  start-up CPU: no model actor became ready"
