"""Model throughput: our Qwen3.5 vs transformers on the same weights (CPU, fp32), side by side.

    python3 -m benchmarks.bench_model [--threads 1] [--prompt 512] [--decode 64] [--iters 3] [--model-dir DIR]

Writes a Qwen3.5-shaped random dense checkpoint of ~25M parameters (hidden 512, 8 layers
in the [DeltaNet x3, attention] pattern, vocab 4096; `make_tiny_checkpoint` with
overrides) unless `--model-dir` is given, loads it with `load_model` and with
transformers' `AutoModelForImageTextToText`, checks the two agree on the prompt's
logits, then measures for one sequence (or `--batch` equal-length sequences):
- prefill tokens/s: one forward over a `--prompt`-token prompt (median of `--iters`);
- decode tokens/s: `--decode` single-token steps after that prefill with each one's cache
  (ours: `ContiguousCache`; transformers: its own cache via `past_key_values`).
Ours and the reference alternate within each iteration; the ratio is ours / reference.
Times are this process's CPU seconds (`time.process_time`): on a shared machine wall time
swings with other load, CPU time does not; with one thread (the default) the two agree
on an idle machine.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

BENCH_TEXT = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    vocab_size=4096,
)


def _clock() -> float:
    """CPU seconds of this process: stable on a shared machine, equal to wall time when idle
    for one thread (with more threads it sums them, so compare ratios at equal --threads)."""
    return time.process_time()


def _ours_run(model, ids, n_decode):
    from vlbatch.operators.model import ContiguousCache

    cache = ContiguousCache(model.config.text, ids.shape[0], capacity=ids.shape[1] + n_decode)
    t0 = _clock()
    logits = model(ids, cache=cache, logits_to_keep=1)
    t1 = _clock()
    for _ in range(n_decode):
        logits = model(logits[:, -1:].argmax(-1), cache=cache, logits_to_keep=1)
    return t1 - t0, _clock() - t1


@torch.no_grad()
def _ref_run(ref, ids, n_decode):
    t0 = _clock()
    out = ref(input_ids=ids, use_cache=True, logits_to_keep=1)
    t1 = _clock()
    for _ in range(n_decode):
        out = ref(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    return t1 - t0, _clock() - t1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared box)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: one)")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForImageTextToText

    from vlbatch.devtools.checkpoints import make_tiny_checkpoint
    from vlbatch.operators.model import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_dir or make_tiny_checkpoint(tmp, "dense", **BENCH_TEXT)
        ours = load_model(path)
        ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in ours.parameters())
    vocab = ours.config.text.vocab_size
    ids = torch.randint(0, min(vocab, 770), (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids, logits_to_keep=8) - ref(input_ids=ids, logits_to_keep=8).logits).abs().max().item()
    print(f"model: {n_params / 1e6:.1f}M params, threads {args.threads}, prompt {args.prompt}, "
          f"decode {args.decode}, batch {args.batch}; max |logits diff| vs transformers: {diff:.2e}")

    _ours_run(ours, ids[:, :32], 2), _ref_run(ref, ids[:, :32], 2)  # warm-up
    times = {"ours": ([], []), "transformers": ([], [])}
    for _ in range(args.iters):
        for name, fn, m in (("ours", _ours_run, ours), ("transformers", _ref_run, ref)):
            prefill, decode = fn(m, ids, args.decode)
            times[name][0].append(prefill)
            times[name][1].append(decode)

    toks = (args.batch * args.prompt, args.batch * args.decode)
    rates = {n: (toks[0] / statistics.median(p), toks[1] / statistics.median(d)) for n, (p, d) in times.items()}
    print(f"{'':14}{'prefill tok/s':>16}{'decode tok/s':>16}")
    for name, (p, d) in rates.items():
        print(f"{name:14}{p:16.1f}{d:16.1f}")
    (op, od), (rp, rd) = rates["ours"], rates["transformers"]
    print(f"{'ratio':14}{op / rp:15.2f}x{od / rd:15.2f}x   (ours / transformers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
