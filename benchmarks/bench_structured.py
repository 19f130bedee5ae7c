"""Constrained decoding cost in the engine (issue 52): unconstrained vs a JSON schema vs choices, one run.

    python -m benchmarks.bench_structured [--requests 64] [--new-tokens 64] [--threads 1] [--model-dir DIR]

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
compilations per arm (one per distinct format per engine). Step times are process CPU seconds (one
thread: wall time on an idle machine, steady on a loaded one); the mask split wall seconds; tokens/s wall.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

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
    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText

    from benchmarks.bench_engine import SIZES, _chat, _processor, _requests

    ref = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    proc = _processor(ckpt)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (*SIZES[i % len(SIZES)], 3), dtype=np.uint8) for i in range(n)]
    texts = [f"Describe image {i}." for i in range(n)]
    return _requests(proc, ref, [_chat(proc, "image", t) for t in texts], images, "image", new_tokens, "r")


def _arm(ckpt, reqs, fmt, n: int) -> dict:
    """One fresh engine over `reqs` (with `fmt`): step times, mask seconds, tokens."""
    from vlbatch.operators.factory import load_engine

    engine = load_engine(ckpt, kv_budget_bytes=256 << 20, max_num_seqs=n)
    if fmt is not None:  # constrained requests end at the checkpoint's stop token once the value is whole
        reqs = [replace(r, response_format=fmt, sampling=replace(r.sampling, stop_token_ids=None)) for r in reqs]
    g = engine.grammars
    engine.submit(reqs)
    full, tokens, t_start = [], 0, time.perf_counter()
    while engine.has_work:
        running = engine.scheduler.running
        decoding = not engine.num_waiting and len(running) == n and all(s.t_first for s in running)
        f0, a0, t0 = g.fill_s, g.apply_s, time.process_time()
        done = engine.step()
        dt = time.process_time() - t0  # CPU seconds of this process (one thread): steady on a loaded machine
        if decoding:
            full.append((dt, g.fill_s - f0, g.apply_s - a0))
        tokens += sum(r.generated_tokens for r in done)
    wall = time.perf_counter() - t_start
    return {"wall": wall, "tokens": tokens, "full": full, "fill": g.fill_s, "apply": g.apply_s,
            "compilations": engine.stats()["grammar_compilations"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args(argv)
    import torch

    from benchmarks.bench_engine import BENCH_TEXT
    from vlbatch.devtools.checkpoints import make_tiny_checkpoint
    from vlbatch.operators.engine.request import ResponseFormat

    torch.set_num_threads(args.threads)
    arms = {"free": None, "json": ResponseFormat("json_schema", json.dumps(SCHEMA)),
            "choice": ResponseFormat("choice", json.dumps(CHOICES))}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.model_dir) if args.model_dir else make_tiny_checkpoint(Path(tmp) / "ckpt", "dense",
                                                                                 **BENCH_TEXT)
        reqs = _requests(ckpt, args.requests, args.new_tokens)
        out = {name: _arm(ckpt, reqs, fmt, args.requests) for name, fmt in arms.items()}
    base = statistics.median(s[0] for s in out["free"]["full"]) if out["free"]["full"] else None
    print(f"{args.requests} image requests, {args.new_tokens} new tokens, {args.threads} thread(s), step CPU seconds")
    for name, r in out.items():
        steps = r["full"]
        med = statistics.median(s[0] for s in steps) if steps else None
        fill = statistics.median(s[1] for s in steps) if steps else 0.0
        apply = statistics.median(s[2] for s in steps) if steps else 0.0
        ratio = f"{med / base:.3f}x free" if med and base else "n/a (no full-batch decode step)"
        rest = (med or 0.0) - fill - apply
        print(f"{name:>6}: {r['tokens'] / r['wall']:8.1f} tok/s ({r['tokens']} tokens, {r['wall']:.2f} s); "
              f"full-batch decode steps {len(steps)}: median {med * 1e3 if med else 0:.2f} ms = mask fill "
              f"{fill * 1e3:.2f} + mask apply {apply * 1e3:.2f} + rest {rest * 1e3:.2f} ms; "
              f"step ratio {ratio}; grammar compilations {r['compilations']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
