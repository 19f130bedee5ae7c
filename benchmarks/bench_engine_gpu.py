"""Engine decode throughput against the memory-bandwidth roofline (the GPU run of issue 5).

    python -m benchmarks.bench_engine_gpu [--shape 9b|tiny] [--device cuda] [--dtype bfloat16]
        [--requests 64] [--new-tokens 128] [--delta-kernels auto] [--peak-gbs 4800] [--check-kernels]

Writes a random-weight checkpoint of the chosen shape in the Hugging Face layout and loads
it through `load_engine`, as a real checkpoint is loaded. `9b` is Qwen3.5-9B's
configuration (seed 000 section 1: text 4096 wide, 32 layers [DeltaNet x3, attention] x 8,
FFN 12288, attention 16 / 4 heads of 256, DeltaNet 16 key / 32 value heads of 128, vocab
248320, untied head; vision 27 layers of 1152, FFN 4304, merger to 4096): ~9.6B parameters,
19 GB of weights in bf16. Matrices are N(0, 0.02), biases 0, other vectors (norms, A_log) 1.
`--requests` image captions (random images of 448 to 672 px: 196 to 441 visual tokens)
generate `--new-tokens` each (eos ignored, so every request generates them all).

Figures: generated tokens/s end to end (vision, prefill, decode); and over the steps in which
every running sequence decodes (no prefill), tokens/s and their time against the roofline:
the bytes a decode step must move (decoder and LM-head weights once, the K/V of every running
sequence's context, every DeltaNet state read and written) / the device's bandwidth, measured
here by a device-to-device copy (`--peak-gbs` adds the nominal figure, 4800 GB/s for an H200).
`--check-kernels` first runs 4 requests with the torch and then fla's DeltaNet kernels and
prints the share of identical greedy tokens (bf16 rounding may let them part after a while).
`--check-backends` compares greedy tokens of sdpa / triton attention with static decode off
and on; `--vs-transformers N` times transformers' `generate` on N requests in the same run.
Timed runs come after two warm-ups (the second reaches every decode bucket, so CUDA graph
captures are not timed).
On the CPU, `--shape tiny --device cpu --dtype float32` runs in seconds (tests run it so).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vlbatch.operators.kernels.attention import ATTENTION
from vlbatch.operators.kernels.delta_rule import DELTA_RULE

NINE_B_TEXT = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_num_key_heads=16, linear_num_value_heads=32, vocab_size=248320,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True})
NINE_B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, num_position_embeddings=2304)
SHAPES = {"9b": (NINE_B_TEXT, NINE_B_VISION), "tiny": ({}, {})}
SIZES = [(448, 448), (448, 672), (672, 448), (576, 576), (672, 672), (512, 640)]


def write_config(out: Path, shape: str, use_transformers: bool = True) -> Path:
    """config.json, tokenizer and processor configs of a shape. config.json as transformers
    saves it; where its installed version has no Qwen3.5 (a device machine's may be older), the
    dict before transformers normalises it, which our config reader parses to the same config."""
    from vlbatch.devtools.checkpoints.tiny import tiny_config_dict, write_tokenizer_and_processor

    text, vision = SHAPES[shape]
    cfg = tiny_config_dict("dense", vision, **text)
    out.mkdir(parents=True, exist_ok=True)
    config_cls = None
    if use_transformers:
        try:
            from transformers import Qwen3_5Config as config_cls
        except ImportError:
            pass
    if config_cls is None:
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    else:
        cfg.pop("model_type")
        config_cls(**cfg).save_pretrained(out)
    write_tokenizer_and_processor(out)
    return out


def write_random_weights(out: Path, device: str, dtype: torch.dtype, seed: int = 0) -> int:
    """model.safetensors with every parameter our model has, random; returns the parameter count."""
    from safetensors.torch import save_file

    from vlbatch.operators.model import ModelConfig, Qwen35Model

    with torch.device("meta"):
        model = Qwen35Model(ModelConfig.from_pretrained(out))
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        t = torch.empty(p.shape, device=device, dtype=dtype)
        if p.dim() > 1:
            t.normal_(0.0, 0.02, generator=gen)
        else:
            t.fill_(0.0 if name.endswith("bias") else 1.0)
        tensors[name if name == "lm_head.weight" else f"model.{name}"] = t.cpu()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return sum(t.numel() for t in tensors.values())


def make_requests(model_dir: Path, n: int, new_tokens: int, seed: int = 0) -> list:
    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.preprocess import Processor

    proc = Processor.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    return [Request.from_processor(f"r{i}", proc(text=text, images=[rng.integers(0, 256, (*SIZES[i % len(SIZES)], 3),
                                                                                    dtype=np.uint8)]), sampling=sp)
            for i in range(n)]


def copy_bandwidth(device: str, mib: int = 1024, reps: int = 10) -> float:
    """Achievable device memory bandwidth, bytes/s: reads + writes of a device-to-device copy."""
    x = torch.empty(mib << 18, dtype=torch.float32, device=device)  # mib MiB
    y = torch.empty_like(x)
    y.copy_(x)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    _sync(device)
    return 2 * x.nbytes * reps / (time.perf_counter() - t0)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode_weight_bytes(model) -> int:
    """Weights a decode step reads once: the decoder (not the embedding table: a step reads B
    rows of it) and the LM head."""
    lm = model.language_model
    skip = {id(p) for p in lm.embed_tokens.parameters()}
    total = sum(p.numel() * p.element_size() for p in lm.parameters() if id(p) not in skip)
    head = model.lm_head.weight if model.lm_head is not None else lm.embed_tokens.weight
    return total + head.numel() * head.element_size()


def timed_run(engine, reqs: list, device: str) -> dict:
    """Generate everything step by step; time each step, and the decode-only ones apart."""
    stats, dec = engine.runner.stats, []
    n_tokens = 0
    _sync(device)
    t0 = time.perf_counter()
    engine.submit(reqs)
    while engine.has_work:
        ctx = sum(s.num_tokens for s in engine.scheduler.running)
        prefill0, decode0, s0 = stats.prefill_tokens, stats.decode_tokens, time.perf_counter()
        n_tokens += sum(r.generated_tokens for r in engine.step())
        _sync(device)
        if stats.prefill_tokens == prefill0 and stats.decode_tokens > decode0:
            dec.append((stats.decode_tokens - decode0, time.perf_counter() - s0, ctx))
    return {"wall_s": time.perf_counter() - t0, "generated": n_tokens, "decode_steps": dec}


def check_kernels(engine, reqs: list, device: str, budgets: dict, names=("torch", "fla")) -> str:
    """The same requests through the torch and then fla's DeltaNet kernels (`names`) on the
    loaded model (one load; engines without prefix / vision caches, so the second run
    recomputes everything)."""
    from vlbatch.operators.engine import Engine, EngineConfig
    from vlbatch.operators.kernels.delta_rule import select_delta_rule

    cfg = EngineConfig(**{**budgets, "prefix_cache_bytes": 0, "vision_cache_bytes": 0})
    runs = {}
    for k, name in enumerate(names):
        engine.model.use_delta_kernels(select_delta_rule(device, name))
        run_engine = Engine(engine.model, engine.tokenizer, engine.eos_ids, cfg)
        runs[k] = {r.id: r.token_ids for r in run_engine.generate(reqs)}
    pairs = [(a, b) for rid in runs[0] for a, b in zip(runs[0][rid], runs[1][rid], strict=True)]
    first = [next((i for i, (a, b) in enumerate(zip(runs[0][r], runs[1][r], strict=True)) if a != b), None)
             for r in runs[0]]
    return (f"{sum(a == b for a, b in pairs)} of {len(pairs)} greedy tokens identical; first difference per request "
            f"at {first} (None: none)")


def check_backends(engine, reqs: list, budgets: dict) -> str:
    """Greedy tokens of the same requests through every attention backend, static decode off
    and on (one load; no prefix / vision caches), each against the first (sdpa, eager)."""
    from vlbatch.operators.engine import Engine, EngineConfig

    names = ("sdpa", "triton") if torch.device(engine.model.device).type == "cuda" else ("sdpa",)
    runs = {}
    for attention in names:
        for static in (False, True):
            cfg = EngineConfig(**{**budgets, "prefix_cache_bytes": 0, "vision_cache_bytes": 0,
                                  "attention": attention, "static_decode": static})
            e = Engine(engine.model, engine.tokenizer, engine.eos_ids, cfg)
            runs[(attention, static)] = {r.id: r.token_ids for r in e.generate(reqs)}
    base = runs[(names[0], False)]
    parts = []
    for key, got in runs.items():
        same = sum(a == b for rid in base for a, b in zip(base[rid], got[rid], strict=True))
        parts.append(f"{key[0]}{'+static' if key[1] else ''} {same}/{sum(len(t) for t in base.values())}")
    return "greedy tokens identical to sdpa eager: " + ", ".join(parts)


def transformers_baseline(model_dir: Path, n: int, new_tokens: int, device: str, dtype: torch.dtype) -> dict:
    """transformers' `generate` (greedy, one request at a time, `new_tokens` each) on the first
    `n` of `make_requests`' images: images/s and generated tokens/s."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    rng = np.random.default_rng(0)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    images = [rng.integers(0, 256, (*SIZES[i % len(SIZES)], 3), dtype=np.uint8) for i in range(n)]
    generated, t0 = 0, None
    for i, img in enumerate([images[0], *images]):  # the first one again as warm-up
        if i == 1:
            _sync(device)
            t0 = time.perf_counter()
        inputs = proc(text=[text], images=[img], return_tensors="pt").to(device)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        generated += (out.shape[1] - inputs["input_ids"].shape[1]) if i else 0
    _sync(device)
    wall = time.perf_counter() - t0
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"images_per_s": n / wall, "tokens_per_s": generated / wall, "wall_s": wall}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--delta-kernels", default="auto", choices=DELTA_RULE.choices())
    ap.add_argument("--kv-gb", type=float, default=16.0, help="paged KV pool")
    ap.add_argument("--peak-gbs", type=float, default=None, help="nominal bandwidth, GB/s (H200: 4800)")
    ap.add_argument("--check-kernels", action="store_true",
                    help="first compare the torch and fla kernels' greedy tokens (CUDA)")
    ap.add_argument("--dir", default=None, help="checkpoint folder (reused when it holds one)")
    ap.add_argument("--attention", default="sdpa", choices=ATTENTION.choices())
    ap.add_argument("--static-decode", action="store_true", help="decode steps on static buffers (CUDA graphs)")
    ap.add_argument("--check-backends", action="store_true", help="greedy tokens across attention backends and "
                                                                  "static decode off / on")
    ap.add_argument("--vs-transformers", type=int, default=0, metavar="N",
                    help="also time transformers' generate on N of the requests (one at a time)")
    args = ap.parse_args(argv)
    from vlbatch.operators.factory import load_engine

    dtype = getattr(torch, args.dtype)
    out = Path(args.dir or tempfile.mkdtemp(prefix=f"bench_gpu_{args.shape}_"))
    t0 = time.perf_counter()
    if not (out / "model.safetensors").is_file():
        write_config(out, args.shape)
        write_random_weights(out, args.device, dtype)
    print(f"checkpoint {out} ({args.shape}) ready in {time.perf_counter() - t0:.1f} s")
    reqs = make_requests(out, args.requests, args.new_tokens)
    budgets = dict(kv_budget_bytes=int(args.kv_gb * 2**30), max_num_seqs=max(args.requests, 1),
                   max_num_batched_tokens=8192, attention=args.attention, static_decode=args.static_decode)
    engine = load_engine(out, device=args.device, dtype=dtype, delta_rule=args.delta_kernels, **budgets)
    layer = next(m for m in engine.model.modules() if hasattr(m, "kernels"))
    if args.check_kernels:
        print(f"torch vs fla DeltaNet kernels: {check_kernels(engine, reqs[:4], args.device, budgets)}")
        engine.model.use_delta_kernels(layer.kernels)
    if args.check_backends:
        print(check_backends(engine, reqs[:4], budgets))
    timed_run(engine, reqs[:2], args.device)  # warm-up: CUDA context, kernel compilation
    # warm-up of every decode bucket (graph captures) on other images: no vision-cache hits later
    timed_run(engine, make_requests(out, args.requests, args.new_tokens, seed=1), args.device)
    run = timed_run(engine, reqs, args.device)
    res = report(args, engine, run, copy_bandwidth(args.device), layer.kernels.name)
    if args.vs_transformers:
        ref = transformers_baseline(out, min(args.vs_transformers, args.requests), args.new_tokens, args.device,
                                    dtype)
        print(f"  transformers generate (one at a time): {ref['images_per_s']:.2f} images/s, "
              f"{ref['tokens_per_s']:.1f} tok/s; engine {res['images_per_s']:.2f} images/s, "
              f"{res['tokens_per_s']:.1f} tok/s: x{res['tokens_per_s'] / ref['tokens_per_s']:.1f}")
        res["transformers"] = ref
    return res


def report(args, engine, run: dict, bandwidth: float, kernels: str) -> dict:
    weights = decode_weight_bytes(engine.model)
    dec = run["decode_steps"]
    d_tokens, d_time = sum(b for b, _, _ in dec), sum(t for _, t, _ in dec)
    moved = sum(weights + ctx * engine.kv_bytes_per_token + 2 * b * engine.state_bytes_per_seq for b, _, ctx in dec)
    res = {"generated": run["generated"], "wall_s": run["wall_s"], "tokens_per_s": run["generated"] / run["wall_s"],
           "images_per_s": args.requests / run["wall_s"],
           "decode_steps": len(dec), "decode_tokens_per_s": d_tokens / d_time if d_time else 0.0,
           "weight_bytes": weights, "bytes_moved": moved, "bandwidth": bandwidth,
           "roofline_fraction": (moved / bandwidth) / d_time if d_time else 0.0, "kernels": kernels}
    print(f"{args.requests} captions x {args.new_tokens} tokens, {args.shape} {args.dtype} on {args.device}, "
          f"DeltaNet kernels {kernels}, attention {args.attention}, static decode {args.static_decode}")
    print(f"  end to end: {res['generated']} tokens in {res['wall_s']:.2f} s: {res['tokens_per_s']:.1f} tok/s, "
          f"{res['images_per_s']:.2f} images/s")
    print(f"  decode-only steps: {len(dec)}, {d_tokens} tokens in {d_time:.2f} s: "
          f"{res['decode_tokens_per_s']:.1f} tok/s (mean batch {d_tokens / max(len(dec), 1):.1f})")
    print(f"  a decode step moves {weights / 2**30:.2f} GiB of weights + K/V + states: {moved / 2**30:.1f} GiB over "
          f"those steps; at the measured {bandwidth / 1e9:.0f} GB/s (copy) that takes {moved / bandwidth:.2f} s: "
          f"{res['roofline_fraction']:.2f} of the roofline")
    if args.peak_gbs:
        print(f"  against the nominal {args.peak_gbs:.0f} GB/s: {moved / (args.peak_gbs * 1e9) / d_time:.2f}")
    return res


if __name__ == "__main__":
    main()
