"""Where one decode step's time goes: the bench checkpoint, N running sequences, cProfile of steady decode steps.

    OMP_NUM_THREADS=1 python -m benchmarks.profile_decode [--seqs 64] [--prompt 150] [--steps 40] [--top 25]
                                                          [--static]

bench_engine's (a) splits a whole run (prefill and decode) by phase; this isolates the decode
step, the part a GPU engine repeats most and where host time must hide under the device's step:
milliseconds per step unprofiled, then per step under cProfile (which inflates Python calls about
1.5x): the matmuls, each compiled kernel, and the rest grouped by file (Python, torch's per-op
dispatch, small torch ops), largest first. Prompts are random text tokens, caches off, so every
step is a decode step over all `--seqs` sequences. Figures for people, from the CPU it runs on.

It also prints the step's host time outside the model's forward (scheduling, step inputs,
sampling, finishing): with CUDA graphs (`--static`: decode steps on static buffers, as
`model.engine.static_decode` runs them on a GPU) the forward is one graph launch, and this is what
must stay below the device's step time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_engine import BENCH_TEXT


def _engine(tmp: Path, seqs: int, prompt: int, steps: int, static: bool):
    from vlbatch.devtools.checkpoints import make_tiny_checkpoint
    from vlbatch.operators.engine.request import Request, SamplingParams
    from vlbatch.operators.factory import load_engine

    ckpt = make_tiny_checkpoint(tmp / "ckpt", "dense", **BENCH_TEXT)
    engine = load_engine(ckpt, kv_budget_bytes=64 << 20, prefix_cache_bytes=0, vision_cache_bytes=0,
                         max_num_seqs=seqs, max_num_batched_tokens=4096, static_decode=static)
    rng = np.random.default_rng(0)
    pos = torch.arange(prompt).expand(3, prompt).clone()
    sp = SamplingParams(max_new_tokens=3 * steps + 8, stop_token_ids=())
    engine.submit([Request(id=f"r{i}", prompt_token_ids=tuple(rng.integers(10, 4000, prompt).tolist()),
                           position_ids=pos, sampling=sp) for i in range(seqs)])
    while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in engine.scheduler.running):
        engine.step()  # the prefill steps
    return engine


def _groups(stats: pstats.Stats) -> dict[str, float]:
    """Self seconds by what they are: matmuls, each compiled kernel, else the file (or builtin)."""
    out: dict[str, float] = {}
    for (path, _line, name), (_cc, _nc, self_s, _cum, _callers) in stats.stats.items():
        if path == "~":
            key = "matmuls" if "_nn.linear" in name else f"torch / builtin: {name[:48]}"
        elif name.endswith("_kernel"):
            key = f"compiled: {Path(path).parent.name}/{Path(path).stem}.{name}"
        else:
            key = "python: " + "/".join(Path(path).parts[-3:])
        out[key] = out.get(key, 0.0) + self_s
    return out


class _ForwardClock:
    """CPU seconds spent inside `model.forward_packed` (wrapped on the instance until `stop`)."""

    def __init__(self, model):
        self.model, self.seconds = model, 0.0
        inner = model.forward_packed

        def timed(*args, **kwargs):
            t = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t
        model.forward_packed = timed

    def stop(self) -> float:
        del self.model.forward_packed  # the class's method again
        return self.seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=150)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--static", action="store_true", help="decode steps on static buffers (CUDA graphs' path)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = _engine(Path(tmp), args.seqs, args.prompt, args.steps, args.static)
        forward = _ForwardClock(engine.runner.model)
        start = time.process_time()
        for _ in range(args.steps):
            engine.step()
        plain = (time.process_time() - start) / args.steps
        host = plain - forward.stop() / args.steps
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
    groups = _groups(pstats.Stats(prof))
    total = sum(groups.values()) / args.steps
    print(f"decode step, {args.seqs} sequences (prompts {args.prompt} tokens): {1e3 * plain:.2f} ms unprofiled; "
          f"{1e3 * total:.2f} ms under cProfile, by self time:")
    print(f"  host outside the forward{' (static decode)' if args.static else ''}: {1e3 * host:.2f} ms per step, "
          f"{1e6 * host / args.seqs:.1f} us per sequence")
    for key, s in sorted(groups.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {1e3 * s / args.steps:7.3f} ms  {key}")


if __name__ == "__main__":
    main()
