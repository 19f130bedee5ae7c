"""Engine throughput and memory against references measured side by side (CPU, fp32).

    python3 -m benchmarks.bench_engine [--threads 1] [--requests 64] [--new-tokens 64]
        [--videos 16] [--questions 8] [--ref-batches 8,64] [--model-dir DIR]
        [--part a|b|c] [--quick] [--profile N] [--repeat N]

`--part` runs one part only (c needs the engine of (a), so it runs (a) too); `--quick`
shrinks the workload (16 captions, 4 videos x 4 questions, reference batch 16) for
iterating; `--profile N` prints the top N functions of a cProfile of the engine runs.

Writes a Qwen3.5-shaped random dense checkpoint (~25M parameters: hidden 512, 8 layers in
the [DeltaNet x3, attention] pattern; `make_tiny_checkpoint` overrides) unless
`--model-dir` is given. Requests are built by transformers' processor (+ its
`get_rope_index`), the same inputs for every contender.
(a) `--requests` image-captioning prompts with varied image sizes, `--new-tokens` each
    (eos ignored so every contender generates the same number): our engine vs
    transformers `generate` (greedy, left padding) at each `--ref-batches` size, best kept.
(b) `--videos` videos x `--questions` questions: the engine with prefix + vision caches
    vs the same engine with both off; vision tower calls of each; `--repeat N` runs N rounds
    of (on, off) and prints each round's speed-up and the median (the machine's speed drifts
    between runs: one pair can be 10 % off).
(c) peak RSS of this process after the engine runs (before the reference loads), KV bytes
    per token, DeltaNet state bytes per sequence.
Linear layers (every `F.linear` call, which both models make for all their projections) are
timed inside each (a) run, and the engine's run is split by phase (`phases.py`: prefill delta
rule, decode state, attention, matmuls, python / host; (b)'s two runs too): the engine's own linear-layer seconds
bound what any engine can reach on this CPU, so (a)'s ceiling is reference seconds / engine linear seconds, and
(b) prints its matmul seconds off / on: the speed-up of engines whose only cost were their matmuls (the work the
caches save), beside off total / on matmuls.
Times are process CPU seconds (`time.process_time`, stable on a shared machine; equal to
wall time for one thread on an idle one); wall seconds are printed beside them.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.phases import PhaseTimer

BENCH_TEXT = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8, vocab_size=4096)
# image sizes whose token counts really differ (64 to 192 visual tokens; smaller ones are upscaled to 64)
SIZES = [(256, 256), (256, 384), (384, 256), (320, 320), (256, 512), (384, 384), (448, 320), (512, 384)]
QUESTIONS = ["What happens in this video?", "Where was it filmed?", "How many people appear?",
             "What colour is the main object?", "Describe the camera motion.", "Is it day or night?",
             "What is the mood?", "Summarise it in one sentence."]


def _timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


class LinearTimer:
    """Within `with`, CPU seconds spent in `torch.nn.functional.linear` (patched for the block;
    models look it up at call time) accumulate in `seconds`."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def __enter__(self):
        import torch.nn.functional as F

        self._orig = orig = F.linear

        def timed(*args, **kwargs):
            t0 = time.process_time()
            out = orig(*args, **kwargs)
            self.seconds += time.process_time() - t0
            self.calls += 1
            return out

        F.linear = timed
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.linear = self._orig


def sgemm_gflops(n: int = 512, reps: int = 20) -> float:
    """This CPU's float32 matmul rate at the current torch thread count: best of `reps` n^3 products."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def _processor(ckpt):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(ckpt)
    proc.tokenizer.padding_side = "left"
    return proc


def _chat(proc, kind: str, question: str) -> str:
    msgs = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
    return proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)


def _requests(proc, ref, texts, media, kind, new_tokens, prefix):
    from vlbatch.operators.engine import Request, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    out = []
    for i, (text, m) in enumerate(zip(texts, media, strict=False)):
        kw = {"images": [m]} if kind == "image" else {
            "videos": [m], "do_sample_frames": False,
            "video_metadata": [{"fps": 2.0, "total_num_frames": len(m), "frames_indices": list(range(len(m)))}]}
        enc = dict(proc(text=[text], return_tensors="pt", **kw))
        enc["position_ids"], enc["rope_deltas"] = ref.model.get_rope_index(
            enc["input_ids"], enc["mm_token_type_ids"], enc.get("image_grid_thw"), enc.get("video_grid_thw"),
            enc["attention_mask"])
        out.append(Request.from_processor(f"{prefix}{i}", enc, sampling=sp))
    return out


def _engine_run(ckpt, reqs, prof, timer=None, **kw):
    """`timer`: a `LinearTimer`, or a `phases.PhaseTimer` (installed in the engine first)."""
    from contextlib import nullcontext

    from vlbatch.operators.factory import load_engine

    engine = load_engine(ckpt, **kw)
    if isinstance(timer, PhaseTimer):
        timer.install(engine)
    if prof is not None:
        prof.enable()
    with timer or nullcontext():
        results, cpu, wall = _timed(lambda: list(engine.generate(reqs)))
    if prof is not None:
        prof.disable()
    return engine, results, cpu, wall


def _print_memory(engine, rss_mb: float, s_on: dict | None) -> None:
    print("\n(c) memory")
    print(f"  peak RSS after the engine runs: {rss_mb:.0f} MiB (process total, model + pools + caches)")
    print(f"  KV bytes per token: {engine.kv_bytes_per_token} (all full-attention layers, K + V)")
    print(f"  DeltaNet state bytes per sequence: {engine.state_bytes_per_seq}")
    pool = engine.runner.pool
    line = (f"  KV pool: {engine.blocks.num_blocks} blocks x {engine.blocks.block_size} tokens = "
            f"{engine.runner.kv.nbytes / 2**20:.0f} MiB; state pool: {pool.num_slots} slots = "
            f"{(pool.conv.nbytes + pool.recurrent.nbytes) / 2**20:.0f} MiB")
    if s_on is not None:
        line += (f"; prefix cache after (b): {s_on['prefix_cache_bytes'] / 2**20:.1f} MiB; "
                 f"vision cache after (b): {s_on['vision_cache_bytes'] / 2**20:.1f} MiB")
    print(line)


def _reference(ref, proc, texts, images, new_tokens, batch, timer):
    total = 0

    def run():
        nonlocal total
        for s in range(0, len(texts), batch):
            enc = proc(text=texts[s: s + batch], images=images[s: s + batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                out = ref.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            total += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

    with timer:
        _, cpu, wall = _timed(run)
    return total, cpu, wall


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--videos", type=int, default=16)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--video-new-tokens", type=int, default=16)
    ap.add_argument("--ref-batches", default="8,64")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--part", choices=["a", "b", "c"], default=None, help="run one part only")
    ap.add_argument("--quick", action="store_true", help="small workload for iterating")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the engine runs, print top N")
    ap.add_argument("--repeat", type=int, default=1,
                    help="(b): rounds of on, off (the machine's speed drifts: each round's ratio and the median)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.videos, args.questions, args.ref_batches = 16, 4, 4, "16"
    return args


def _part_a_engine(args, ckpt, reqs, prof, budgets):
    """(a) the engine's run: (engine, tokens / CPU s, its phase timer), printed."""
    phases = PhaseTimer()
    engine, res, cpu, wall = _engine_run(ckpt, reqs, prof, phases, **budgets)
    gen = sum(r.generated_tokens for r in res)
    print(f"\n(a) {args.requests} captions x {args.new_tokens} tokens "
          f"(prompts {min(r.prompt_len for r in reqs)}-{max(r.prompt_len for r in reqs)} tokens)")
    print(f"  engine:        {gen} tokens in {cpu:.1f} s cpu ({wall:.1f} s wall): {gen / cpu:.1f} tok/s; "
          f"linear layers {phases.seconds['matmuls']:.1f} s")
    print(f"  engine phases (cpu):\n{phases.split(cpu)}")
    print(f"  targets ({_cpu_model()}):\n{phases.targets(cpu, sgemm_gflops())}")
    return engine, gen / cpu, phases


def _part_a_reference(args, ref, proc, texts, images, eng_tps: float, phases: PhaseTimer) -> None:
    """(a) transformers `generate` at each batch size; the ratio to the best and the ceiling, printed."""
    best, best_cpu = None, None
    for b in [int(x) for x in args.ref_batches.split(",")]:
        ref_linear = LinearTimer()
        tot, rcpu, rwall = _reference(ref, proc, texts, images, args.new_tokens, b, ref_linear)
        print(f"  transformers generate, batch {b:3d}: {tot} tokens in {rcpu:.1f} s cpu "
              f"({rwall:.1f} s wall): {tot / rcpu:.1f} tok/s; linear layers {ref_linear.seconds:.1f} s")
        if best is None or tot / rcpu > best:
            best, best_cpu = tot / rcpu, rcpu
    print(f"  ratio engine / best transformers: {eng_tps / best:.2f}x")
    print(f"  ceiling (best reference cpu / the engine's linear-layer cpu, i.e. an engine whose only "
          f"cost were its matmuls): {best_cpu / phases.seconds['matmuls']:.2f}x")


def _part_b_runs(ckpt, reqs, prof, budgets, rounds: int) -> dict:
    """(b) the same requests with prefix + vision caches on, then off, `rounds` times; each run
    split by phase. -> {"on" / "off": the first round's run, "rounds": [(on cpu, off cpu)]}."""
    out: dict = {"rounds": []}
    for _ in range(rounds):
        pair = {}
        for side, kw in (("on", budgets), ("off", {**budgets, "prefix_cache_bytes": 0, "vision_cache_bytes": 0})):
            phases = PhaseTimer()
            engine, res, cpu, wall = _engine_run(ckpt, reqs, prof, phases, **kw)
            pair[side] = dict(tokens={r.id: r.token_ids for r in res}, cpu=cpu, wall=wall, stats=engine.stats(),
                              phases=phases)
            del engine
        out.setdefault("on", pair["on"])
        out.setdefault("off", pair["off"])
        out["rounds"].append((pair["on"]["cpu"], pair["off"]["cpu"],
                              pair["on"]["tokens"] == pair["off"]["tokens"] == out["on"]["tokens"]))
    return out


def _part_b_print(args, reqs, b: dict) -> None:
    on, off = b["on"], b["off"]
    print(f"\n(b) {args.videos} videos x {args.questions} questions, {args.video_new_tokens} new tokens each "
          f"(prompts ~{reqs[0].prompt_len} tokens, {reqs[0].visual_tokens} visual)")
    for side in ("on", "off"):
        r, s = b[side], b[side]["stats"]
        print(f"  caches {side + ':':<4} {r['cpu']:.1f} s cpu ({r['wall']:.1f} s wall), vision tower calls "
              f"{s['vision_encodes']}, prefix hit tokens {s['prefix_hit_tokens']}, prefill tokens "
              f"{s['prefill_tokens']}, decode tokens {s['decode_tokens']}")
        print(f"  caches {side}, phases (cpu):\n{r['phases'].split(r['cpu'])}")
        print(f"  caches {side}, targets:\n{r['phases'].targets(r['cpu'], sgemm_gflops())}; snapshots inserted "
              f"{s['snapshots_inserted']}, prefix evicted nodes {s['prefix_evicted_nodes']}")
    mm_on, mm_off = on["phases"].seconds["matmuls"], off["phases"].seconds["matmuls"]
    print(f"  speed-up: {off['cpu'] / on['cpu']:.2f}x; identical outputs: {on['tokens'] == off['tokens']}")
    if len(b["rounds"]) > 1:
        ratios = [f / o for o, f, _ in b["rounds"]]
        print(f"  rounds (on, off cpu s): {', '.join(f'{o:.1f} / {f:.1f}' for o, f, _ in b['rounds'])}; speed-ups "
              f"{', '.join(f'{r:.2f}' for r in ratios)}: median {float(np.median(ratios)):.2f}x; identical outputs in "
              f"every round: {all(same for _, _, same in b['rounds'])}")
    # what the caches save is work: with every other cost gone on both sides the ratio is the matmuls'
    print(f"  matmul seconds off / on (the speed-up of engines whose only cost were their matmuls): "
          f"{mm_off / mm_on:.2f}x; off total / on matmuls: {off['cpu'] / mm_on:.2f}x")


def main(argv=None) -> int:
    args = _args(argv)
    do_a, do_b = args.part in (None, "a", "c"), args.part in (None, "b")
    torch.set_num_threads(args.threads)
    # this process is ours: the compiled kernels at this machine's faster SIMD width (first: before any
    # of our modules defines one), glibc keeping freed step temporaries (host_memory.py) for both contenders
    from vlbatch.operators.host_simd import use_fastest_simd

    simd = use_fastest_simd()
    from vlbatch.operators.engine.host_memory import retain_freed_memory

    retain_freed_memory()
    from transformers import AutoModelForImageTextToText

    from vlbatch.devtools.checkpoints import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.model_dir) if args.model_dir else make_tiny_checkpoint(Path(tmp) / "ckpt", "dense",
                                                                                 **BENCH_TEXT)
        ref = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
        print(f"checkpoint: {sum(p.numel() for p in ref.parameters()) / 1e6:.1f}M parameters, "
              f"threads={args.threads}, fp32 CPU: {_cpu_model()}")
        print(simd.describe())
        proc = _processor(ckpt)
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (*SIZES[i % len(SIZES)], 3), dtype=np.uint8) for i in range(args.requests)]
        cap_texts = [_chat(proc, "image", "Describe this image.")] * args.requests
        cap_reqs = _requests(proc, ref, cap_texts, images, "image", args.new_tokens, "img")
        # 392 visual tokens each
        videos = [rng.integers(0, 256, (16, 224, 224, 3), dtype=np.uint8) for _ in range(args.videos)]
        vqa_media = [v for v in videos for _ in range(args.questions)]
        vqa_texts = [_chat(proc, "video", QUESTIONS[q % len(QUESTIONS)]) for _ in videos for q in range(args.questions)]
        vqa_reqs = _requests(proc, ref, vqa_texts, vqa_media, "video", args.video_new_tokens, "vid")
        budgets = dict(kv_budget_bytes=64 << 20, prefix_cache_bytes=64 << 20, max_num_seqs=64,
                       max_num_batched_tokens=4096)

        prof = cProfile.Profile(time.process_time) if args.profile else None  # CPU time: the machine may be shared
        if do_a:
            engine, eng_tps, phases = _part_a_engine(args, ckpt, cap_reqs, prof, budgets)
        b = _part_b_runs(ckpt, vqa_reqs, prof, budgets, args.repeat) if do_b else None
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if do_a:
            _part_a_reference(args, ref, proc, cap_texts, images, eng_tps, phases)
        if do_b:
            _part_b_print(args, vqa_reqs, b)
        if do_a:
            _print_memory(engine, rss_mb, b["on"]["stats"] if do_b else None)
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
            pstats.Stats(prof).sort_stats("cumtime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
