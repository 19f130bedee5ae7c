"""Which prefill form of the torch delta rule runs on this machine: timed once, at first use.

Candidates (`CANDIDATES`): the packed chunked rule (`packed.py`: batched GEMMs over chunks of
16, 32 or 64 tokens) and, on the CPU, the compiled token scan (`cpu_scan.py`). Which is
fastest depends on the CPU (small batched GEMMs are cheap on one, slow on another) and the
shapes, so `PrefillTuner.choose` times each on a small synthetic packed problem of the
first call's head shapes (4 sequences, 212 tokens: a few ms per candidate), best of two
runs, once per process and head shape (`timed_choice`, cached: every model loaded in the
process, e.g. a benchmark's caches-on and caches-off engines, runs the same form, so their
outputs stay bit-identical). Every candidate is exact (tests/test_kernels_delta_tuning.py checks each against
the naive loop on odd shapes), so the choice is speed only. On CUDA: chunks of 64, untimed.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlbatch.operators.kernels.delta_rule import cpu_scan
from vlbatch.operators.kernels.delta_rule.packed import chunk_gated_delta_rule_packed

CANDIDATES = ("scan", "gemm16", "gemm32", "gemm64")
PROBE_LENS = (91, 64, 37, 20)  # the synthetic packed problem: odd lengths, chunk tails of every size
CUDA_FORM = "gemm64"


def run_form(form: str, q, k, v, g, beta, state, lens):
    """`DeltaRuleKernels.prefill` by the named candidate."""
    if form == "scan":
        return cpu_scan.prefill_scan_cpu(q, k, v, g, beta, state, lens)
    if form in CANDIDATES:
        return chunk_gated_delta_rule_packed(q, k, v, g, beta, state, lens, int(form[4:]))
    raise ValueError(f"unknown delta-rule prefill form {form!r}; known: {', '.join(CANDIDATES)}")


def probe_problem(h: int, dk: int, dv: int, lens=PROBE_LENS, seed: int = 0):
    """A packed problem as `GatedDeltaNet` hands it: q, k L2-normalised (q scaled), g < 0."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.5
    beta = torch.rand(t, h, generator=gen)
    state = torch.randn(len(lens), h, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state, tuple(lens)


@functools.cache
def timed_choice(h: int, dk: int, dv: int) -> tuple[str, tuple[tuple[str, float], ...]]:
    """(fastest form, (form, best seconds) per candidate) on the probe problem of these head
    shapes; computed once per process."""
    problem = probe_problem(h, dk, dv)
    timings = []
    for form in CANDIDATES:
        best = float("inf")
        for _ in range(2):  # the first run also warms caches and the allocator
            t0 = time.perf_counter()
            run_form(form, *problem)
            best = min(best, time.perf_counter() - t0)
        timings.append((form, best))
    return min(timings, key=lambda ft: ft[1])[0], tuple(timings)


@dataclass
class PrefillTuner:
    """The chosen form (None until the first call) and the probe's seconds per candidate."""

    form: str | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def choose(self, q: torch.Tensor, v: torch.Tensor) -> str:
        if self.form is None:
            if q.device.type != "cpu":
                self.form = CUDA_FORM
            else:
                self.form, timings = timed_choice(q.shape[1], q.shape[2], v.shape[2])
                self.timings = dict(timings)
        return self.form

    def describe(self) -> str:
        """One line for logs and benchmarks: the choice and each candidate's probe time."""
        if self.form is None:
            return "delta-rule prefill: not chosen yet"
        times = ", ".join(f"{f} {1e3 * s:.2f} ms" for f, s in self.timings.items())
        return f"delta-rule prefill: {self.form}" + (f" (probe: {times})" if times else " (CUDA default)")
