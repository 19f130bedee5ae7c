"""Where a pipeline's start-up CPU goes: CPU seconds per process until the model actor is ready.

    with StartupCpu() as probe:          # a thread samples every process's CPU times
        summary = run_job(cfg)
    print(probe.report(window_s=summary.model_ready_after_s))

On a small machine the start-up is CPU-bound: every Ray worker process (the actor pools, Ray
Data's own actors, refills of Ray's idle-worker pool) imports ray, often ray.data (pandas) and
torch at once, and the model actor, whose start-up the engine waits for, gets its share of the
cores. The report lists each process's CPU seconds from the run's start to the model actor's
readiness (its Ray process title, e.g. `ray::MapWorker(MapBatches(ModelStage))`), the total
against the cores' capacity in that window, and the model actor's own seconds: the part no
scheduling change can remove. psutil comes with Ray (its thirdparty_files), so nothing is added.
"""
from __future__ import annotations

import os
import threading
import time


class StartupCpu:
    """Samples (process title, created, CPU s) of every process on the machine while entered."""

    def __init__(self, every_s: float = 0.2):
        self.every_s = every_s
        self.samples: dict[int, dict] = {}  # pid -> {"title", "created", "cpu": [(t, cpu s)]}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-cpu", daemon=True)

    def __enter__(self) -> StartupCpu:
        import ray  # noqa: F401 - puts Ray's bundled psutil on the path

        self.start = time.time()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        """Take one sample of every process now (the thread calls it every `every_s`)."""
        import psutil

        now = time.time()
        for p in psutil.process_iter(["pid", "create_time"]):
            try:  # everything read before anything is kept: a process gone half-way leaves no empty entry
                cpu = p.cpu_times()
                title = " ".join(p.cmdline())[:60] or p.name()
            except (psutil.Error, OSError):  # gone, or not ours to read
                continue
            entry = self.samples.setdefault(p.pid, {"created": p.info["create_time"], "cpu": []})
            entry["title"] = title
            entry["cpu"].append((now, cpu.user + cpu.system))

    def cpu_between(self, pid: int, t0: float, t1: float) -> float:
        """CPU seconds process `pid` used between t0 and t1 (the samples bracketing them)."""
        entry = self.samples[pid]

        def at(t: float) -> float:
            before = [c for s, c in entry["cpu"] if s <= t]
            if before:
                return before[-1]
            return entry["cpu"][0][1] if entry["created"] <= t else 0.0  # running already: its first sample

        return at(t1) - at(t0)

    def report(self, window_s: float | None, top: int = 12) -> str:
        """Per process, CPU s from the start to `window_s` later (the model actor ready), largest first."""
        if window_s is None:
            return "  start-up CPU: no model actor became ready"
        t0, t1 = self.start, self.start + window_s
        rows = sorted(((self.cpu_between(pid, t0, t1), e["title"], e["created"] - t0)
                       for pid, e in self.samples.items()), reverse=True)
        rows = [r for r in rows if r[0] >= 0.05]
        total, cores = sum(r[0] for r in rows), os.cpu_count() or 1
        model = sum(r[0] for r in rows if "ModelStage" in r[1])
        lines = [f"  start-up CPU, the {window_s:.1f} s to the model actor ready: {total:.1f} CPU s used of "
                 f"{cores * window_s:.1f} available on {cores} cores; the model actor's own {model:.1f} s"]
        for cpu, title, created in rows[:top]:
            when = "before the start" if created < 0 else f"started +{created:.1f} s"
            lines.append(f"    {cpu:5.2f} s  {title:<60s} ({when})")
        return "\n".join(lines)
