"""Constrained decoding cost in the engine (issue 52): unconstrained vs a JSON schema vs choices, one run.

    python -m benchmarks.bench_structured [--requests 64] [--new-tokens 64] [--threads 1] [--model-dir DIR]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--shape bench|tiny] [--json FILE]

The engine on `--requests` image requests (bench_engine's Qwen3.5-shaped random checkpoint, ~25M
parameters, unless `--model-dir`), `--new-tokens` each, three arms on fresh engines:
- `free`: no response format (the stop token ignored, so every request decodes all its tokens);
- `json`: a JSON schema with an enum, an integer and a list of strings (no item bound, so a random model
  keeps writing strings and the batch stays full);
- `choice`: one of four long answers (20-40 tokens, so full-batch decode steps exist).
Per arm: tokens/s and the decode steps split into mask computation (`GrammarBook.fill_s`: the matchers'
bitmask fill), mask application (`apply_s`: one `apply_token_bitmask_inplace` call) and the rest; the
ratio printed is the median decode-step time of an arm over the free arm's, over steps with the whole
batch (`--requests` sequences) decoding (target <= 1.15 at batch 64 on the CPU); and the grammar
compilations per arm (one per distinct format per engine). Step times are process CPU seconds on the CPU
(one thread: wall time on an idle machine, steady on a loaded one), wall seconds on CUDA (a step ends with
its tokens on the host); the mask split wall seconds; tokens/s wall.

Overlap (`overlap` in the JSON; benchmarks/gpu_run.sh's 04_structured on a lent GPU): the engine fills a
step's bitmasks on the CPU after the forward is launched and before its logits are read, so on CUDA the fill
can run while the GPU computes. Per constrained arm: the median mask fill against the free arm's median step
(the forward and the rest), and how much of the fill the step hides: `hidden = 1 - (extra - apply) / fill`
(clamped to [0, 1]), `extra` the arm's median step over the free arm's; "hidden" when at least half is. On
the CPU the forward and the fill share the thread: nothing is hidden there, by construction.
`--shape tiny` (gpu_run.sh --rehearse): the tiny test checkpoint instead of the ~25M one. Without xgrammar
(a device env it was not carried to: benchmarks/gpu_wheels.sh) one line `skipped: ...` and exit 0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

NEGLIGIBLE = 0.05  # a mask fill under 5% of the forward is within the steps' noise: not judged (`overlap`)
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["circle", "square", "triangle", "star"]},
    "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["kind", "count", "tags"]}
# long answers (20-40 tokens each), so the batch is still full once every prompt is prefilled
CHOICES = ["a red circle in the top left corner of the picture, beside a small blue square",
           "a green triangle in the middle of the picture, above a yellow star and a grey line",
           "two squares side by side at the bottom of the picture, both of them purple",
           "nothing at all that could be named: the picture is noise from edge to edge"]


def _requests(ckpt, n: int, new_tokens: int):
    """`n` image requests made by our processor (the reference's, bit for bit: tests/test_model_parity.py;
    transformers' own needs torchvision, which the device env lacks)."""
    import numpy as np

    from benchmarks.bench_engine import SIZES
    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.preprocess import Processor

    proc = Processor.from_pretrained(ckpt)
    sp = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        image = rng.integers(0, 255, (*SIZES[i % len(SIZES)], 3), dtype=np.uint8)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Describe image {i}."}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True)
        out.append(Request.from_processor(f"r{i}", proc(text=text, images=[image]), sampling=sp))
    return out


def _arm(ckpt, reqs, fmt, n: int, device: str = "cpu", dtype: str = "float32") -> dict:
    """One fresh engine over `reqs` (with `fmt`): step times, mask seconds, tokens."""
    from vlbatch.operators.factory import load_engine

    engine = load_engine(ckpt, device=device, dtype=dtype, kv_budget_bytes=256 << 20, max_num_seqs=n)
    clock = time.process_time if device == "cpu" else time.perf_counter
    if fmt is not None:  # constrained requests end at the checkpoint's stop token once the value is whole
        reqs = [replace(r, response_format=fmt, sampling=replace(r.sampling, stop_token_ids=None)) for r in reqs]
    g = engine.grammars
    engine.submit(reqs)
    full, tokens, t_start = [], 0, time.perf_counter()
    while engine.has_work:
        running = engine.scheduler.running
        decoding = not engine.num_waiting and len(running) == n and all(s.t_first for s in running)
        f0, a0, t0 = g.fill_s, g.apply_s, clock()
        done = engine.step()
        dt = clock() - t0  # CPU: seconds of this process (one thread), steady on a loaded machine; CUDA: wall
        if decoding:
            full.append((dt, g.fill_s - f0, g.apply_s - a0))
        tokens += sum(r.generated_tokens for r in done)
    wall = time.perf_counter() - t_start
    return {"wall": wall, "tokens": tokens, "full": full, "fill": g.fill_s, "apply": g.apply_s,
            "compilations": engine.stats()["grammar_compilations"]}


def _stats(r: dict, base: float | None) -> dict:
    """One arm's figures: tokens/s, its full-batch decode steps' medians (s) and its step ratio to free."""
    steps = r["full"]
    med = statistics.median(s[0] for s in steps) if steps else None
    fill = statistics.median(s[1] for s in steps) if steps else 0.0
    apply = statistics.median(s[2] for s in steps) if steps else 0.0
    return {"tokens_per_s": r["tokens"] / r["wall"], "tokens": r["tokens"], "wall_s": r["wall"],
            "full_steps": len(steps), "median_step_s": med, "fill_s": fill, "apply_s": apply,
            "rest_s": (med or 0.0) - fill - apply, "ratio": med / base if med and base else None,
            "compilations": r["compilations"]}


def overlap(arm: dict, free: dict, device: str) -> dict:
    """How much of `arm`'s mask fill its steps hide behind the forward (module docstring); `arm`, `free`:
    `_stats`. A fill under `NEGLIGIBLE` of the forward is within the steps' noise: said so, not judged."""
    fill, forward = arm["fill_s"], free["median_step_s"]
    if arm["median_step_s"] is None or forward is None or fill <= 0:
        return {"fill_s": fill, "forward_s": forward, "extra_s": None, "hidden": None, "verdict": "n/a"}
    extra = arm["median_step_s"] - forward
    hidden = min(1.0, max(0.0, 1.0 - max(extra - arm["apply_s"], 0.0) / fill))
    share = f"the fill is {fill / forward:.1%} of the forward"
    if device == "cpu":  # one thread runs both: nothing to hide behind, whatever the noise says
        hidden, verdict = None, f"not overlapped on the CPU (one thread runs both); {share}"
    elif fill < NEGLIGIBLE * forward:
        verdict = f"negligible: {share}, hidden or not"
    else:
        verdict = "hidden behind the forward" if hidden >= 0.5 else "adds to the step (not overlapped)"
    return {"fill_s": fill, "forward_s": forward, "extra_s": extra, "hidden": hidden, "verdict": verdict}


def _skip(why: str, path: str | None) -> int:
    print(f"skipped: {why}")
    if path:
        Path(path).write_text(json.dumps({"skipped": why}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shape", default="bench", choices=["bench", "tiny"], help="tiny: the test checkpoint")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        import xgrammar  # noqa: F401 - the grammar engine (and its pydantic, tvm-ffi), carried as wheels
    except ImportError as e:
        return _skip(f"no xgrammar in the device env ({type(e).__name__}: {e}); carry it: benchmarks/gpu_wheels.sh",
                     args.json)
    import torch

    from benchmarks.bench_engine import BENCH_TEXT
    from vlbatch.devtools.checkpoints import make_tiny_checkpoint
    from vlbatch.operators.engine.request import ResponseFormat

    if args.device == "cuda" and not torch.cuda.is_available():
        return _skip("no CUDA device", args.json)
    torch.set_num_threads(args.threads)
    arms = {"free": None, "json": ResponseFormat("json_schema", json.dumps(SCHEMA)),
            "choice": ResponseFormat("choice", json.dumps(CHOICES))}
    with tempfile.TemporaryDirectory() as tmp:
        shape = BENCH_TEXT if args.shape == "bench" else {}
        ckpt = Path(args.model_dir) if args.model_dir else make_tiny_checkpoint(Path(tmp) / "ckpt", "dense", **shape)
        reqs = _requests(ckpt, args.requests, args.new_tokens)
        raw = {name: _arm(ckpt, reqs, fmt, args.requests, args.device, args.dtype) for name, fmt in arms.items()}
    base = statistics.median(s[0] for s in raw["free"]["full"]) if raw["free"]["full"] else None
    stats = {name: _stats(r, base) for name, r in raw.items()}
    over = {name: overlap(stats[name], stats["free"], args.device) for name in arms if name != "free"}
    unit = "CPU" if args.device == "cpu" else "wall"
    print(f"{args.requests} image requests, {args.new_tokens} new tokens, {args.threads} thread(s), {args.device} "
          f"{args.dtype}, step {unit} seconds")
    for name, st in stats.items():
        med = st["median_step_s"]
        ratio = f"{st['ratio']:.3f}x free" if st["ratio"] else "n/a (no full-batch decode step)"
        print(f"{name:>6}: {st['tokens_per_s']:8.1f} tok/s ({st['tokens']} tokens, {st['wall_s']:.2f} s); "
              f"full-batch decode steps {st['full_steps']}: median {med * 1e3 if med else 0:.2f} ms = mask fill "
              f"{st['fill_s'] * 1e3:.2f} + mask apply {st['apply_s'] * 1e3:.2f} + rest {st['rest_s'] * 1e3:.2f} ms; "
              f"step ratio {ratio}; grammar compilations {st['compilations']}")
    for name, o in over.items():
        if o["extra_s"] is None:
            print(f"{name:>6}: overlap n/a (no full-batch decode step or no mask fill)")
            continue
        hidden = "" if o["hidden"] is None else f" ({o['hidden']:.0%} of the fill hidden)"
        print(f"{name:>6}: mask fill {o['fill_s'] * 1e3:.2f} ms per step vs forward (free step) "
              f"{o['forward_s'] * 1e3:.2f} ms; the step grows {o['extra_s'] * 1e3:.2f} ms{hidden}: {o['verdict']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"skipped": None, "device": args.device, "dtype": args.dtype,
                                               "requests": args.requests, "new_tokens": args.new_tokens,
                                               "arms": stats, "overlap": over}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
