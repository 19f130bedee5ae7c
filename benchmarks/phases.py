"""Where an engine run's CPU time goes, by phase (benchmarks only: nothing in the product
times itself).

`PhaseTimer.install(engine)` wraps the engine's own kernel objects, the gated delta rule of
every DeltaNet layer (`Qwen35Model.use_delta_kernels`) and the runner's paged attention,
in timing twins that add `time.process_time()` deltas around each call; within `with`,
`torch.nn.functional.linear` (every projection, the vision tower's and the LM head's too)
is timed the same way, and so are the model's compiled CPU ops (`operators/model/ops`: RMSNorm
and the gated norm, the causal conv's step and packed forms, the DeltaNet q / k heads, the
attention q / k norm + MRoPE, the vision input's frames -> patches pass; on a GPU each is a
device kernel, so it is not host time).
`split(total)` is the per-phase table; "python / host" is the rest of `total`: Python, torch's
per-op dispatch, and the unfused elementwise ops (activations, residual adds, casts, copies),
embeddings, sampling and scheduling. The phases are disjoint: none of the timed calls calls
another (a compiled op calling another, the gated norm its plain norm, is timed once).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F

from vlbatch.operators.kernels.attention.base import PagedAttention
from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels

PHASES = ("prefill delta rule", "decode state", "attention", "matmuls", "compiled CPU ops")
# (module, function) of the decoder's compiled CPU ops, looked up by the model through their modules
CPU_OPS = (("conv_cpu", "conv1d_step_cpu"), ("conv_cpu", "conv1d_packed_cpu"), ("heads_cpu", "qk_heads_cpu"),
           ("norm_cpu", "rms_norm_cpu"), ("norm_cpu", "gated_rms_norm_cpu"), ("rope_cpu", "norm_rope_cpu"),
           ("pixels_cpu", "normalize_frames_cpu"))


class PhaseTimer:
    """CPU seconds per phase (`PHASES`) of the engines it is installed in, while entered."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.steps = 0  # engine steps (runner calls)
        self.seq_steps = 0  # sum over steps of the sequences in the step
        self.delta_flops = 0.0  # the prefill rule's work: 6 T H K V (3 multiply-adds per state element per token)
        self.delta = None  # the engine's delta-rule kernels (their `tuner` says which prefill form runs)

    def add(self, phase: str, start: float) -> None:
        self.seconds[phase] += time.process_time() - start
        self.calls[phase] += 1

    def install(self, engine) -> None:
        engine.runner.attention = TimedAttention(engine.runner.attention, self)
        kernels = {m.kernels for m in engine.model.modules() if isinstance(getattr(m, "kernels", None),
                                                                          DeltaRuleKernels)}
        if len(kernels) != 1:
            raise ValueError(f"expected one delta rule implementation in the model, found {len(kernels)}")
        self.delta = kernels.pop()
        engine.model.use_delta_kernels(TimedDeltaRule(self.delta, self))
        run = engine.runner.run

        def counted(plan):  # steps and running sequences, for host time per step / per sequence
            self.steps += 1
            self.seq_steps += len(plan.chunks)
            return run(plan)

        engine.runner.run = counted

    def __enter__(self):
        self._linear = linear = F.linear

        def timed(*args, **kwargs):
            start = time.process_time()
            out = linear(*args, **kwargs)
            self.add("matmuls", start)
            return out

        F.linear = timed
        self._ops = [(m, name, getattr(m, name)) for m, name in _cpu_op_functions()]
        depth = [0]  # the outermost compiled op is timed (gated norm -> norm: once)

        def timed_op(fn):
            def call(*args, **kwargs):
                depth[0] += 1
                start = time.process_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    if not depth[0]:
                        self.add("compiled CPU ops", start)
            return call

        for m, name, fn in self._ops:
            setattr(m, name, timed_op(fn))
        return self

    def __exit__(self, *exc):
        F.linear = self._linear
        for m, name, fn in self._ops:
            setattr(m, name, fn)

    def split(self, total: float) -> str:
        """One line per phase: seconds, share of `total`, calls; then the rest (python / host)."""
        rows = [(p, self.seconds[p], f"{self.calls[p]} calls") for p in PHASES]
        rows.append(("python / host", total - sum(self.seconds.values()), "the rest"))
        return "\n".join(f"    {name:<20} {s:6.2f} s  {100 * s / total:5.1f}%  ({note})" for name, s, note in rows)

    def targets(self, total: float, sgemm_gflops: float) -> str:
        """The machine-independent figures: overhead factor (engine / its matmuls, target <= 1.5),
        host share (target <= 15 %), host per step and per running sequence, the delta rule's
        achieved GFLOP/s beside this CPU's sgemm GFLOP/s, and the chosen prefill form."""
        host = total - sum(self.seconds.values())
        rule = self.seconds["prefill delta rule"]
        lines = [f"    overhead factor (engine cpu / its matmul cpu): {total / self.seconds['matmuls']:.2f} "
                 "(target <= 1.5)",
                 f"    host share (python / host above): {100 * host / total:.1f}% (target <= 15 %); "
                 "host per engine step "
                 f"{1e3 * host / max(self.steps, 1):.2f} ms ({self.steps} steps), per running sequence per step "
                 f"{1e6 * host / max(self.seq_steps, 1):.0f} us ({self.seq_steps} sequence-steps)",
                 f"    prefill delta rule: {self.delta_flops / max(rule, 1e-9) / 1e9:.2f} GFLOP/s achieved "
                 f"(6 T H K V) vs this CPU's sgemm {sgemm_gflops:.1f} GFLOP/s (1 thread, 512^3)"]
        tuner = getattr(self.delta, "tuner", None)
        if tuner is not None:
            lines.append(f"    {tuner.describe()}")
        return "\n".join(lines)


def _cpu_op_functions():
    from vlbatch.operators.model.ops import conv_cpu, heads_cpu, norm_cpu, pixels_cpu, rope_cpu

    modules = {"conv_cpu": conv_cpu, "heads_cpu": heads_cpu, "norm_cpu": norm_cpu, "pixels_cpu": pixels_cpu,
               "rope_cpu": rope_cpu}
    return [(modules[m], name) for m, name in CPU_OPS]


@dataclass(frozen=True, eq=False)
class TimedDeltaRule(DeltaRuleKernels):
    """`inner`'s prefill, decode_ and decode_slots_, timed into `timer`."""

    inner: DeltaRuleKernels
    timer: PhaseTimer
    name: ClassVar[str] = "timed"

    def prefill(self, q, k, v, g, beta, state, lens):
        start = time.process_time()
        out = self.inner.prefill(q, k, v, g, beta, state, lens)
        self.timer.add("prefill delta rule", start)
        self.timer.delta_flops += 6.0 * q.shape[0] * q.shape[1] * q.shape[2] * v.shape[2]
        return out

    def decode_(self, q, k, v, g, beta, state):
        start = time.process_time()
        out = self.inner.decode_(q, k, v, g, beta, state)
        self.timer.add("decode state", start)
        return out

    def decode_slots_(self, q, k, v, g, beta, pool, slots):
        start = time.process_time()
        out = self.inner.decode_slots_(q, k, v, g, beta, pool, slots)
        self.timer.add("decode state", start)
        return out


@dataclass(frozen=True, eq=False)
class TimedAttention(PagedAttention):
    """`inner`'s paged attention, timed into `timer`."""

    inner: PagedAttention
    timer: PhaseTimer
    name: ClassVar[str] = "timed"

    def __call__(self, layout, k_cache, v_cache, q, k, v, rows=None):
        start = time.process_time()
        out = self.inner(layout, k_cache, v_cache, q, k, v, rows)
        self.timer.add("attention", start)
        return out
