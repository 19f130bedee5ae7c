"""The CPU profiling tools of benchmarks/ run and report what they say they do (small sizes;
the figures themselves are for people, not asserted)."""
from __future__ import annotations

import os
import time

import pytest

from benchmarks import profile_decode
from benchmarks.startup_cpu import StartupCpu


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_profile_decode_splits_a_decode_step(capsys):
    profile_decode.main(["--seqs", "3", "--prompt", "12", "--steps", "2", "--top", "200"])
    out = capsys.readouterr().out
    assert "decode step, 3 sequences (prompts 12 tokens)" in out
    assert "matmuls" in out and "compiled: delta_rule/cpu_scan.scan_kernel" in out
    assert "compiled: attention/cpu_decode._kernel" in out
    assert "host outside the forward: " in out and " us per sequence" in out


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_profile_decode_static_times_the_host_around_the_forward(capsys):
    profile_decode.main(["--seqs", "3", "--prompt", "12", "--steps", "2", "--top", "5", "--static"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "host outside the forward" in ln)
    host_ms = float(line.split(": ")[1].split(" ms")[0])
    assert "(static decode)" in line and host_ms > 0


@pytest.mark.slow
def test_startup_cpu_counts_this_process_from_its_start():
    # The test takes the window's closing sample itself (the thread's next one is an hour away), so what is
    # counted does not depend on when a loaded machine lets the sampling thread run.
    with StartupCpu(every_s=3600) as probe:
        end = time.process_time() + 0.3
        while time.process_time() < end:  # 0.3 CPU s in this process inside the window
            pass
        probe.sample()
        window = time.time() - probe.start
    mine = probe.cpu_between(os.getpid(), probe.start, probe.start + window)
    assert 0.28 <= mine <= window + 0.1, mine  # /proc counts in clock ticks (10 ms)
    report = probe.report(window)
    assert "CPU s used of" in report and "python" in report.lower()
    assert probe.report(None) == "  start-up CPU: no model actor became ready"


def test_startup_cpu_samples_on_its_own_until_it_exits():
    with StartupCpu(every_s=0.01) as probe:
        mine = probe.samples[os.getpid()]["cpu"]
        deadline = time.monotonic() + 120  # a hang guard: the gate is the thread's own samples
        while len(mine) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(mine) >= 3
    after = len(mine)
    time.sleep(0.05)
    assert len(mine) == after  # the thread stopped with the block


def test_startup_cpu_keeps_no_entry_for_a_process_gone_while_sampled(monkeypatch):
    """A process that exits between its CPU times and its command line (seen in a run beside a busy suite:
    the report then failed on an entry without samples). Staged with a stand-in process object, since a
    real one cannot be made to exit at that instant."""
    import psutil

    class Vanishing:
        pid, info = 999_999_999, {"pid": 999_999_999, "create_time": 0.0}

        def cpu_times(self):
            return psutil.Process().cpu_times()

        def cmdline(self):
            raise psutil.NoSuchProcess(self.pid)

    real = psutil.process_iter
    monkeypatch.setattr(psutil, "process_iter", lambda *a, **k: [*real(*a, **k), Vanishing()])
    with StartupCpu(every_s=3600) as probe:
        probe.sample()
    assert Vanishing.pid not in probe.samples
    assert all(e["cpu"] for e in probe.samples.values())
    assert "CPU s used of" in probe.report(time.time() - probe.start)
