"""The 9B-shaped run of benchmarks/gpu_run.sh: our engine against transformers, side by side.

    python3 -m benchmarks.gpu_nine_b --out DIR [--shape 9b|tiny] [--device cuda] [--dtype bfloat16]
        [--dir CKPT] [--memory-fraction 0.9 | --kv-gb 16] [--variants auto,auto+static,triton+static]
        [--requests 64] [--new-tokens 128] [--size 448] [--videos 4] [--questions 8] [--frames 16]
        [--hf-batches 8,32] [--hf-images 32] [--peak-gbs 4800] [--parts captions,video_qa,memory,transformers]

A random-weight checkpoint of the shape (`bench_engine_gpu.write_config` / `write_random_weights`:
the seed's 9B configuration, nothing downloaded) is written to `--dir` unless it holds one,
and loaded once; every part reuses the loaded model. Each part writes its JSON file into
`--out` as soon as it ends (a run stopped by its time limit keeps what it measured):
- 03a_captions.json: `--requests` captions of `--size`^2 random images, `--new-tokens` each (eos
  ignored), per engine variant (`attention[+static]`: static = decode steps on padded buffers,
  CUDA graphs on CUDA): images/s, generated tokens/s, and over the decode-only steps tokens/s
  against the HBM roofline (the bytes a step must move / the copy bandwidth measured here, and
  / `--peak-gbs`), greedy tokens equal to the first variant's; each after a warm-up run on other
  images (reaches every decode bucket: graph captures are not timed).
- 03b_video_qa.json: `--videos` videos x `--questions` questions, prefix + vision caches on vs off.
- 03c_memory.json: the peak allocated memory of those runs against the memory_fraction plan
  (weights + KV pool + DeltaNet slots + prefix cache + vision cache + the profiled activation peak).
- 03d_transformers.json: transformers' `generate` on `--hf-images` of the caption images at each
  `--hf-batches` size (greedy, `--new-tokens` forced), best batch kept, and the engine's ratio.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_engine import QUESTIONS
from benchmarks.bench_engine_gpu import (
    _sync,
    copy_bandwidth,
    decode_weight_bytes,
    write_config,
    write_random_weights,
)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the per-part JSON files")
    ap.add_argument("--shape", choices=["9b", "tiny"], default="9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--dir", default="/tmp/ckpt9b", help="checkpoint folder (reused when it holds one)")
    ap.add_argument("--memory-fraction", type=float, default=None, help="size the pools from free memory")
    ap.add_argument("--kv-gb", type=float, default=16.0, help="KV pool without --memory-fraction")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--variants", default="auto,auto+static,triton+static")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--videos", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--video-new-tokens", type=int, default=32)
    ap.add_argument("--hf-batches", default="8,32")
    ap.add_argument("--hf-images", type=int, default=32)
    ap.add_argument("--peak-gbs", type=float, default=None, help="nominal bandwidth, GB/s (H200: 4800)")
    ap.add_argument("--parts", default="captions,video_qa,memory,transformers")
    return ap.parse_args(argv)


def _dump(out: Path, name: str, obj: dict) -> None:
    (out / name).write_text(json.dumps(obj, indent=1))
    print(f"  -> {name}", flush=True)


def _images(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def _caption_text(proc) -> str:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    return proc.apply_chat_template(msgs, add_generation_prompt=True)


def caption_requests(proc, images: list, new_tokens: int, prefix: str) -> list:
    from vlbatch.operators.engine import Request, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    text = _caption_text(proc)
    return [Request.from_processor(f"{prefix}{i}", proc(text=text, images=[im]), sampling=sp)
            for i, im in enumerate(images)]


def video_requests(proc, videos: int, questions: int, frames: int, size: int, new_tokens: int, seed: int) -> list:
    """Every video asked `questions` questions: one `encode_media` per video, as the pipeline does."""
    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.types import VideoClip

    sp = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    rng, out = np.random.default_rng(seed), []
    for v in range(videos):
        clip = VideoClip(rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8), 2.0, frames,
                         tuple(range(frames)))
        media = proc.encode_media(videos=[clip])
        for q in range(questions):
            msgs = [{"role": "user", "content": [{"type": "video"},
                                                 {"type": "text", "text": QUESTIONS[q % len(QUESTIONS)]}]}]
            enc = {**proc.encode_text(proc.apply_chat_template(msgs, add_generation_prompt=True), media),
                   **media.arrays}
            out.append(Request.from_processor(f"v{v}q{q}", enc, sampling=sp, group=f"v{v}"))
    return out


def run_engine(engine, reqs: list, device: str) -> dict:
    """Everything generated step by step: wall time, tokens per request, decode-only steps
    as (tokens, seconds, context tokens of the running sequences)."""
    stats, dec, tokens = engine.runner.stats, [], {}
    _sync(device)
    t0 = time.perf_counter()
    engine.submit(reqs)
    while engine.has_work:
        ctx = sum(s.num_tokens for s in engine.scheduler.running)
        prefill0, decode0, s0 = stats.prefill_tokens, stats.decode_tokens, time.perf_counter()
        tokens.update({r.id: list(r.token_ids) for r in engine.step()})
        _sync(device)
        if stats.prefill_tokens == prefill0 and stats.decode_tokens > decode0:
            dec.append((stats.decode_tokens - decode0, time.perf_counter() - s0, ctx))
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "decode_steps": dec}


def roofline(engine, run: dict, bandwidth: float, peak_gbs: float | None) -> dict:
    """Decode-only steps against the bytes they must move: decoder + head weights once per
    step, the K/V of every running sequence's context, every DeltaNet state read and written."""
    weights, dec = decode_weight_bytes(engine.model), run["decode_steps"]
    d_tokens, d_time = sum(b for b, _, _ in dec), sum(t for _, t, _ in dec)
    moved = sum(weights + ctx * engine.kv_bytes_per_token + 2 * b * engine.state_bytes_per_seq for b, _, ctx in dec)
    out = {"decode_steps": len(dec), "decode_tokens_per_s": d_tokens / d_time if d_time else 0.0,
           "mean_decode_batch": d_tokens / max(len(dec), 1), "bytes_moved": moved, "weight_bytes": weights,
           "copy_bandwidth_gbs": bandwidth / 1e9,
           "roofline_fraction": (moved / bandwidth) / d_time if d_time else 0.0}
    if peak_gbs:
        out["nominal_roofline_fraction"] = (moved / (peak_gbs * 1e9)) / d_time if d_time else 0.0
    return out


def _engine(base, **changes):
    """A new engine on `base`'s loaded model (`base`: (model, tokenizer, eos_ids, budgets))."""
    from vlbatch.operators.engine import Engine, EngineConfig

    model, tokenizer, eos_ids, budgets = base
    return Engine(model, tokenizer, eos_ids, EngineConfig(**{**budgets, **changes}))


def _free(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def captions(args, base, reqs: list, warm: list, bandwidth: float) -> dict:
    out, first = {}, None
    for name in args.variants.split(","):
        attention, _, static = name.partition("+")
        engine = _engine(base, attention=attention, static_decode=static == "static")
        run_engine(engine, warm, args.device)
        run = run_engine(engine, reqs, args.device)
        gen = sum(len(t) for t in run["tokens"].values())
        first = first or run["tokens"]
        same = sum(a == b for rid in first for a, b in zip(first[rid], run["tokens"][rid], strict=True))
        res = {"images_per_s": len(reqs) / run["wall_s"], "tokens_per_s": gen / run["wall_s"],
               "generated": gen, "wall_s": run["wall_s"], "tokens_same_as_first": f"{same}/{gen}",
               **roofline(engine, run, bandwidth, args.peak_gbs)}
        if torch.device(args.device).type == "cuda":
            res["static_decode_steps"] = engine.stats()["static_decode_steps"]
        out[name] = res
        print(f"  captions, {name}: {res['images_per_s']:.2f} images/s, {res['tokens_per_s']:.1f} tok/s; decode-only "
              f"{res['decode_tokens_per_s']:.1f} tok/s (mean batch {res['mean_decode_batch']:.1f}), "
              f"{res['roofline_fraction']:.2f} of the roofline at {res['copy_bandwidth_gbs']:.0f} GB/s"
              + (f", {res['nominal_roofline_fraction']:.2f} of {args.peak_gbs:.0f} GB/s" if args.peak_gbs else "")
              + f"; tokens as {args.variants.split(',')[0]}: {res['tokens_same_as_first']}", flush=True)
        del engine
        _free(args.device)
    return out


def video_qa(args, base, reqs: list, warm: list, variant: str) -> dict:
    """`reqs` with prefix + vision caches on, then off; each engine first runs `warm` (other
    videos, the same shapes: compilation and graph captures are not timed, nothing is reused)."""
    attention, _, static = variant.partition("+")
    out, tokens = {}, {}
    for side, changes in (("on", {}), ("off", {"prefix_cache_bytes": 0, "vision_cache_bytes": 0})):
        engine = _engine(base, attention=attention, static_decode=static == "static", **changes)
        run_engine(engine, warm, args.device)
        s0 = engine.stats()
        run = run_engine(engine, reqs, args.device)
        s = {k: engine.stats()[k] - s0[k] for k in ("vision_encodes", "prefix_hit_tokens", "prefill_tokens")}
        tokens[side] = run["tokens"]
        out[side] = {"wall_s": run["wall_s"], **s}
        print(f"  video QA, caches {side}: {run['wall_s']:.2f} s, {json.dumps(out[side])}", flush=True)
        del engine
        _free(args.device)
    out["speedup"] = out["off"]["wall_s"] / out["on"]["wall_s"]
    out["identical_outputs"] = tokens["on"] == tokens["off"]
    out["workload"] = {"videos": args.videos, "questions": args.questions, "frames": args.frames, "size": args.size,
                       "new_tokens": args.video_new_tokens, "prompt_tokens": reqs[0].prompt_len, "variant": variant}
    print(f"  video QA: caches on {out['speedup']:.2f}x faster; identical outputs {out['identical_outputs']}")
    return out


def memory(args, base, model) -> dict:
    """Peak allocated bytes since the load against the memory_fraction plan."""
    from vlbatch.operators.engine.caches.memory import profile_step, state_bytes_per_seq
    from vlbatch.operators.engine.config import EngineConfig

    cfg = EngineConfig(**base[3])
    slots = cfg.max_num_seqs * state_bytes_per_seq(model.config.text, model.dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = {"weights": weights, "kv_pool": cfg.kv_budget_bytes, "deltanet_slots": slots,
               "prefix_cache": cfg.prefix_cache_bytes, "vision_cache": cfg.vision_cache_bytes}
    out = {"memory_fraction": args.memory_fraction, "planned_bytes": planned}
    if torch.device(args.device).type != "cuda":
        return {**out, "skipped": "peak memory is measured on CUDA only"}
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    planned["activation_peak"] = profile_step(model, cfg.max_num_batched_tokens)
    total = torch.cuda.mem_get_info()[1]
    out.update(peak_allocated=peak, peak_reserved=reserved, device_total=total, plan_total=sum(planned.values()),
               peak_over_plan=peak / sum(planned.values()), peak_reserved_of_device=reserved / total)
    print(f"  memory: peak allocated {peak / 2**30:.1f} GiB (reserved {reserved / 2**30:.1f}) against the plan's "
          f"{out['plan_total'] / 2**30:.1f} GiB ({out['peak_over_plan']:.2f}); device {total / 2**30:.1f} GiB; plan "
          + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in planned.items()), flush=True)
    return out


def transformers_side(args, ckpt: Path, images: list, engine_best: dict) -> dict:
    """transformers' generate at each batch size over the same caption images (equal sizes:
    equal prompt lengths, no padding); our processor makes the inputs for both sides."""
    import transformers
    from transformers import AutoModelForImageTextToText

    from vlbatch.operators.preprocess import Processor

    dtype = getattr(torch, args.dtype)
    model = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=dtype).to(args.device).eval()
    proc = Processor.from_pretrained(ckpt)
    text = _caption_text(proc)

    def gen(batch: list, n: int) -> int:
        enc = {k: torch.from_numpy(np.asarray(v)).to(args.device) for k, v in proc(text=[text] * len(batch),
               images=batch).items() if k not in ("position_ids", "rope_deltas")}
        with torch.no_grad():
            seq = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return (seq.shape[1] - enc["input_ids"].shape[1]) * seq.shape[0]

    gen(images[:1], 4)  # warm-up
    out = {"transformers": transformers.__version__, "batches": {}}
    for b in (int(x) for x in args.hf_batches.split(",")):
        n = min(max(b, args.hf_images), len(images))
        _sync(args.device)
        t0 = time.perf_counter()
        tokens = sum(gen(images[s:min(s + b, n)], args.new_tokens) for s in range(0, n, b))
        wall = time.perf_counter() - t0
        out["batches"][b] = {"images_per_s": n / wall, "tokens_per_s": tokens / wall, "wall_s": wall}
        print(f"  transformers {transformers.__version__} generate, batch {b}: {n / wall:.2f} images/s, "
              f"{tokens / wall:.1f} tok/s", flush=True)
    best = max(out["batches"].values(), key=lambda r: r["tokens_per_s"])
    out.update(best=best, engine=engine_best, engine_over_best=engine_best["tokens_per_s"] / best["tokens_per_s"])
    print(f"  engine ({engine_best['variant']}) / transformers at its best batch: x{out['engine_over_best']:.2f} "
          "tokens/s", flush=True)
    return out


def _load(args, ckpt: Path):
    """(model, tokenizer, eos_ids, budgets): one load, the budgets as the engine decided them."""
    from vlbatch.operators.factory import load_engine

    budgets = dict(max_num_seqs=max(args.requests, args.videos * args.questions),
                   max_num_batched_tokens=args.max_num_batched_tokens)
    if args.memory_fraction is None:
        budgets["kv_budget_bytes"] = int(args.kv_gb * 2**30)
    engine = load_engine(ckpt, device=args.device, dtype=args.dtype,
                                    memory_fraction=args.memory_fraction, **budgets)
    base = (engine.model, engine.tokenizer, engine.eos_ids, asdict(engine.config))
    del engine
    _free(args.device)
    return base


def main(argv=None) -> int:
    from vlbatch.operators.preprocess import Processor

    args = _args(argv)
    out, ckpt, parts = Path(args.out), Path(args.dir), args.parts.split(",")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (ckpt / "model.safetensors").is_file():
        write_config(ckpt, args.shape)
        write_random_weights(ckpt, args.device, getattr(torch, args.dtype))
    print(f"checkpoint {ckpt} ({args.shape}) ready in {time.perf_counter() - t0:.1f} s", flush=True)
    base = _load(args, ckpt)
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    proc = Processor.from_pretrained(ckpt)
    images = _images(args.requests, args.size, seed=0)
    cap = {}
    if "captions" in parts:
        reqs = caption_requests(proc, images, args.new_tokens, "img")
        warm = caption_requests(proc, _images(args.requests, args.size, seed=1), args.new_tokens, "warm")
        cap = captions(args, base, reqs, warm, copy_bandwidth(args.device))
        _dump(out, "03a_captions.json", {"shape": args.shape, "dtype": args.dtype, "requests": args.requests,
                                         "new_tokens": args.new_tokens, "size": args.size, "budgets": base[3],
                                         "variants": cap})
    best = max(cap, key=lambda k: cap[k]["tokens_per_s"]) if cap else args.variants.split(",")[0]
    if "video_qa" in parts:
        vreqs, vwarm = (video_requests(proc, args.videos, args.questions, args.frames, args.size,
                                       args.video_new_tokens, seed) for seed in (2, 3))
        _dump(out, "03b_video_qa.json", video_qa(args, base, vreqs, vwarm, best))
    if "memory" in parts:
        _dump(out, "03c_memory.json", memory(args, base, base[0]))
    if "transformers" in parts and cap:
        base = None
        _free(args.device)
        _dump(out, "03d_transformers.json", transformers_side(args, ckpt, images,
                                                              {"variant": best, **cap[best]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
