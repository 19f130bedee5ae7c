"""Pipeline throughput vs the engine alone and vs a plain Ray Data + transformers baseline.

    python benchmarks/bench_pipeline.py [--model bench|tiny|shapes-tiny|DIR] [--media 480]
        [--questions 2] [--max-tokens 16] [--baseline-media 48] [--skip-baseline] [--quick]
    python benchmarks/bench_pipeline.py --videos 6 [--video-seconds 60] [--decoders decord pyav torchcodec]
        (video mode: benchmarks/pipeline_video.py)

Same requests (`--media` images x `--questions` questions), three ways, side by side in one
run on a local Ray (local output):
1. engine alone: vlbatch.operators.engine on the requests decoded and preprocessed beforehand (not
   timed), all in one `generate` call: the ceiling. Run before and after the pipeline; the
   faster run is the ceiling (the machine is shared; the slower run would flatter the ratio);
2. the vlbatch pipeline (`run_job`): manifest, expand, decode + preprocess (one fused CPU
   actor pool), model, write, all timed, Ray already started (actor start-up included);
3. baseline: `ray.data` `map_batches` with transformers' AutoProcessor + `generate()` per
   row (what a first attempt looks like), on the first `--baseline-media` media (it is slow).
For each: rows/s end to end, and steady-state rows/s (rows after the first output batch /
time from the first to the last output batch; the engine alone has no start-up inside its
timing, so its one figure is both). Ratios pipeline / engine alone (target >= 0.90, issue 33) end to
end and steady, pipeline / baseline, the pipeline's start-up (expansion, then actors and
model load up to the first committed row), each stage's busy seconds, and the CPU seconds each
process used until the model actor was ready (`startup_cpu.py`: on 2 cores the start-up is
CPU-bound). Then the summary's occupancy (issue 53): per model actor, busy / waiting on the CPU
stage / blocked on output shares of its window, rows/s and generated tokens/s while busy ("speed of
light") beside the whole run's, the verdict; and the pipeline once more with `ray.metrics: false`
(metrics on vs off, rows/s; target <= 2 %; `--skip-metrics-off` leaves it out).

Model: `bench` (default) is the ~25M-parameter Qwen3.5-shaped random checkpoint of
benchmarks/bench_engine.py (hidden 512, 8 layers), big enough that the model stage is the
bottleneck as it is with a real model; `tiny` (the test checkpoint) is so small that fixed
costs dominate everything. On a CPU-only machine the model stage and the CPU stages share the
same cores, and the engine alone has them to itself: the pipeline pays for decode and
preprocess out of the model's CPU budget, which a GPU model stage would not.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


SIZES = [(480, 640), (720, 1280), (1080, 1920), (600, 800), (768, 1024), (512, 512), (1024, 768), (375, 500)]


def make_inputs(work: Path, n_media: int) -> list[str]:
    """n_media distinct photo-like JPEGs (gradient + noise, 375x500 to 1080p): every media is
    new to the vision and prefix caches, as in a real dataset."""
    import numpy as np
    from PIL import Image

    (work / "img").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    bases = {}
    out = []
    for k in range(n_media):
        h, w = SIZES[k % len(SIZES)]
        if (h, w) not in bases:
            y, x = np.mgrid[0:h, 0:w]
            grad = np.stack([x * 200 // w, y * 200 // h, (x + y) * 200 // (h + w)], -1)
            bases[h, w] = (grad + rng.integers(0, 24, (h, w, 3))).astype(np.int16)
        tile = rng.integers(0, 32, (16, 16, 3), dtype=np.int16)  # this image's own pattern
        img = (bases[h, w] + np.tile(tile, (h // 16 + 1, w // 16 + 1, 1))[:h, :w]).astype(np.uint8)
        path = work / "img" / f"img{k:05d}.jpg"
        Image.fromarray(img).save(path, quality=90)
        out.append(str(path))
    return out


def make_model(name: str, work: Path) -> str:
    if name == "shapes-tiny":
        return str(ROOT / "models" / "shapes-tiny")
    if name not in ("bench", "tiny"):
        return name
    from vlbatch.devtools.checkpoints import make_tiny_checkpoint

    over = {}
    if name == "bench":
        from benchmarks.bench_engine import BENCH_TEXT

        over = BENCH_TEXT
    return str(make_tiny_checkpoint(work / "model", "dense", **over))


def job_dict(model: str, manifest: Path, out: Path, args) -> dict:
    """The pipeline's job: one fused CPU pool (0.5 CPU), the model actor (1 CPU), write tasks
    (0.25 CPU): 1.75 CPUs, so writes run beside the actors on a 2-CPU machine."""
    return {
        "model": {"path": model, "dtype": "float32", "device": "auto"},
        "input": {"uri": str(manifest), "format": "jsonl", "columns": {"media_type": None, "questions": "qs"}},
        "task": {"mode": "questions"}, "sampling": {"max_tokens": args.max_tokens},
        "image": {"max_pixels": args.max_pixels},
        "resources": {"fuse_cpu_stages": True,
                      "preprocess": {"num_cpus": 0.5, "batch_size": 8, "max_actors": 1},
                      "model": {"num_cpus": 1, "num_gpus": args.gpus, "batch_size": args.model_batch,
                                "max_concurrent_batches": args.model_calls, "batch_visual_tokens": 65536},
                      "write": {"num_cpus": 0.25, "batch_size": 16, "max_actors": 1}},
        "output": {"uri": str(out), "run_id": "bench"}, "max_error_fraction": 0.0,
    }


def engine_requests(cfg, media: list[str], questions: list[str]) -> list:
    """The requests, decoded and preprocessed (as the pipeline does it, untimed)."""
    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.preprocess import Processor, load_image
    from vlbatch.pipeline.stages.preprocess import chat_messages

    proc = Processor.from_pretrained(cfg.model.path)
    proc.image_config = replace(proc.image_config, max_pixels=cfg.image.max_pixels)
    reqs = []
    for m, uri in enumerate(media):
        img = load_image(Path(uri).read_bytes())
        for k, q in enumerate(questions):
            text = proc.apply_chat_template(chat_messages(q, "image", None), add_generation_prompt=True)
            reqs.append(Request.from_processor(f"{m}-{k}", proc(text=text, images=[img]), 0,
                                               sampling=SamplingParams(max_new_tokens=cfg.sampling.max_tokens),
                                               group=uri))
    return reqs


def engine_alone(cfg, reqs: list) -> dict:
    """rows/s of one `generate` over all requests (model load not timed); CPU seconds beside."""
    from vlbatch.operators.factory import load_engine
    from vlbatch.pipeline.stages.model_place import resolve_device

    eng = load_engine(cfg.model.path, device=resolve_device(cfg.model.device),
                                 dtype=cfg.model.dtype, **cfg.model.engine.engine_kwargs())
    c0, t0 = time.process_time(), time.perf_counter()
    n = sum(1 for r in eng.generate(reqs) if r.finish_reason != "error")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"rows": n, "wall_s": wall, "cpu_s": cpu, "rows_per_s": n / wall, "steady_rows_per_s": n / wall}


class _HFGenerate:
    """The baseline UDF: transformers processor + generate, one row at a time."""

    def __init__(self, model: str, max_tokens: int, max_pixels: int):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        torch.set_num_threads(1)
        self.proc = AutoProcessor.from_pretrained(model, max_pixels=max_pixels)
        self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
        self.max_tokens = max_tokens

    def __call__(self, batch):
        import io

        import torch
        from PIL import Image

        answers = []
        for uri, q in zip(batch["media_uri"], batch["question"], strict=True):
            img = Image.open(io.BytesIO(Path(uri).read_bytes())).convert("RGB")
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
            text = self.proc.apply_chat_template(msgs, add_generation_prompt=True)
            inputs = self.proc(text=[text], images=[img], return_tensors="pt")
            with torch.no_grad():
                seq = self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False)
            answers.append(self.proc.decode(seq[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
        return {"answer": answers}


def baseline(model: str, media: list[str], questions: list[str], args) -> dict:
    import ray

    items = [{"media_uri": m, "question": q} for m in media for q in questions]
    t0 = time.perf_counter()
    ds = ray.data.from_items(items).map_batches(
        _HFGenerate, fn_constructor_kwargs={"model": model, "max_tokens": args.max_tokens,
                                            "max_pixels": args.max_pixels},
        batch_size=8, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1, num_gpus=args.gpus)
    n, first, last, first_n = 0, None, None, 0
    for b in ds.iter_batches(batch_size=None):
        n += len(b["answer"])
        last = time.perf_counter()
        if first is None:
            first, first_n = last, n
    wall = time.perf_counter() - t0
    steady = (n - first_n) / (last - first) if last and last > first else None
    return {"rows": n, "wall_s": wall, "rows_per_s": n / wall, "steady_rows_per_s": steady,
            "startup_s": (first or t0) - t0}


def _fmt(v: float | None, spec: str = "8.2f") -> str:
    return format(v, spec) if v is not None else "       -"


def report(args, model: str, n_req: int, eng: list[dict], pipe, pipe_wall: float, base: dict | None) -> None:
    ceil = max(eng, key=lambda e: e["rows_per_s"])
    p_rps = pipe.committed_by_status.get("ok", 0) / pipe_wall
    p_steady = pipe.steady_rows_per_s
    print(f"requests: {n_req} ({args.media} media x {args.questions} questions), max_tokens {args.max_tokens}, "
          f"max_pixels {args.max_pixels}, model {args.model} ({model}); load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"  {'':38s} {'rows/s':>8s} {'steady':>8s}   rows")
    for k, e in enumerate(eng):
        print(f"  {'engine alone, run ' + str(k + 1):38s} {_fmt(e['rows_per_s'])} {_fmt(e['steady_rows_per_s'])}"
              f" {e['rows']:6d}  ({e['wall_s']:.1f} s wall, {e['cpu_s']:.1f} s cpu)")
    print(f"  {'vlbatch pipeline':38s} {_fmt(p_rps)} {_fmt(p_steady)} {pipe.committed_by_status.get('ok', 0):6d}"
          f"  ({pipe_wall:.1f} s wall)")
    if base is not None:
        print(f"  {'Ray Data + transformers baseline':38s} {_fmt(base['rows_per_s'])} "
              f"{_fmt(base['steady_rows_per_s'])} {base['rows']:6d}  ({base['wall_s']:.1f} s wall, "
              f"{base['startup_s']:.1f} s to its first batch; first {args.baseline_media} media)")
    mean = sum(e["rows_per_s"] for e in eng) / len(eng)
    print(f"  pipeline / engine alone (end to end)   {p_rps / ceil['rows_per_s']:8.2f}  (target >= 0.90; "
          f"{p_rps / mean:.2f} against the mean of the engine runs)")
    if p_steady is not None:
        print(f"  pipeline / engine alone (steady)       {p_steady / ceil['rows_per_s']:8.2f}  "
              f"({p_steady / mean:.2f} against the mean)")
    busy = pipe.stage_seconds.get("model")
    if busy:  # end to end = (engine speed inside the pipeline / alone) x (share of the wall the engine is busy)
        print(f"  decomposed: the model actor's engine ran at {n_req / busy / ceil['rows_per_s']:.2f} of the faster "
              f"engine-alone run ({n_req / busy / mean:.2f} of the mean) and was busy {busy / pipe_wall:.2f} of "
              f"the pipeline's wall time")
        cpu = pipe.stage_seconds.get("model_cpu")
        if cpu:  # below the busy seconds: the engine's thread waited for its core (other processes) or the GIL
            print(f"  the engine's thread had the CPU for {cpu:.1f} of its {busy:.1f} busy seconds ({cpu / busy:.2f}); "
                  f"engine-alone runs took {', '.join(format(e['cpu_s'], '.1f') for e in eng)} CPU s")
    if base is not None:
        print(f"  pipeline / baseline (end to end)       {p_rps / base['rows_per_s']:8.2f}")
        if p_steady is not None and base["steady_rows_per_s"]:
            print(f"  pipeline / baseline (steady)           {p_steady / base['steady_rows_per_s']:8.2f}")
    print(f"  pipeline start-up: expand {pipe.expand_s:.1f} s, then {pipe.time_to_first_row_s or 0:.1f} s to the "
          f"first committed row; stage busy seconds {pipe.stage_seconds}")
    first, goal = pipe.first_row_after_s, max(15.0, 0.1 * pipe_wall)
    if first is not None:  # issue 33: rows leave the model stage as they finish
        print(f"  first committed row {first:.1f} s after the start of {pipe_wall:.1f} s "
              f"(target <= {goal:.1f} s: 15 s or 10 % of the wall, the larger): {'met' if first <= goal else 'NOT met'}"
              + (f"; a model actor was ready {pipe.model_ready_after_s:.1f} s after the start (Ray Data actors "
                 f"started, model loaded)" if pipe.model_ready_after_s is not None else ""))
    if p_steady:  # wall = fixed + rows / steady  ->  rows where end to end reaches 0.9 of the engine alone
        fixed, goal = pipe_wall - n_req / p_steady, 0.9 * ceil["rows_per_s"]
        need = f"{goal * fixed / (1 - goal / p_steady):.0f}" if p_steady > goal else "never (steady < 0.90)"
        print(f"  fixed cost {fixed:.1f} s (wall beyond rows / steady rate): end to end reaches 0.90 from {need} "
              f"requests on at these rates")
    print(f"  pipeline prefix-cache hit rate {pipe.prefix_cache_hit_rate:.2f}, "
          f"vision-cache hit rate {pipe.vision_cache_hit_rate:.2f}")


def occupancy_report(pipe, pipe_wall: float, off=None, off_wall: float | None = None) -> None:
    """The model's occupancy and speed of light (`RunSummary.occupancy` / `model_actors`), and the metrics on
    vs off row when the second run was made."""
    occ = pipe.occupancy or {}
    if occ:
        print(f"  model busy {occ['busy']:.0%}, waiting on the CPU stage {occ['waiting_on_cpu']:.0%}, blocked on "
              f"output {occ['blocked_on_output']:.0%}, rows ready for it {occ['backlog']:.0%} of its window; "
              f"verdict: {occ['verdict'] or 'none (no pool waited past 30 %)'}")
    for a in pipe.model_actors:
        print(f"  model actor {a['actor']}: busy {a['busy_s']:.1f} of {a['window_s']:.1f} s; while busy "
              f"{_fmt(a['rows_per_s_busy'], '.2f')} rows/s, {_fmt(a['generated_tokens_per_s_busy'], '.1f')} gen tok/s; "
              f"whole run {a['run_rows_per_s']:.2f} rows/s, {a['run_generated_tokens_per_s']:.1f} gen tok/s")
    if off is not None:  # steady rates: the second run starts warm (compiled kernels, page cache), its start-up is no
        # metrics cost
        on_rps = pipe.committed_by_status.get("ok", 0) / pipe_wall
        off_rps = off.committed_by_status.get("ok", 0) / off_wall
        on_s, off_s = pipe.steady_rows_per_s, off.steady_rows_per_s
        if on_s and off_s:
            print(f"  metrics on vs off (ray.metrics) steady {on_s:8.2f} vs {off_s:.2f} rows/s: "
                  f"{(on_s - off_s) / off_s:+.1%} (target: within 2 %; the machine's noise included)")
        print(f"  metrics on vs off, end to end          {on_rps:8.2f} vs {off_rps:.2f} rows/s: "
              f"{(on_rps - off_rps) / off_rps:+.1%} (metrics off runs second, warm: start-up differs)")


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench", help="bench (25M, default), tiny, shapes-tiny, or a checkpoint folder")
    ap.add_argument("--media", type=int, default=480)
    ap.add_argument("--questions", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-pixels", type=int, default=65536)
    ap.add_argument("--gpus", type=float, default=0.0)
    ap.add_argument("--baseline-media", type=int, default=48, help="media the (slow) baseline runs on")
    ap.add_argument("--model-batch", type=int, default=16, help="resources.model.batch_size (media per model call)")
    ap.add_argument("--model-calls", type=int, default=8, help="resources.model.max_concurrent_batches")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-metrics-off", action="store_true", help="no second pipeline run with ray.metrics off")
    ap.add_argument("--quick", action="store_true", help="64 media, baseline on 16 (iterating)")
    ap.add_argument("--videos", type=int, default=0, help="video mode: N videos, the job once per --decoders "
                    "(benchmarks/pipeline_video.py); the image options above are then unused")
    ap.add_argument("--video-seconds", type=int, default=60)
    ap.add_argument("--video-max-pixels", type=int, default=128 * 128)
    ap.add_argument("--decoders", nargs="+", default=["decord", "pyav", "torchcodec"])
    args = ap.parse_args(argv)
    if args.quick:
        args.media, args.baseline_media = 64, 16
    return args


def main(argv=None) -> None:
    args = _args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # Ray workers

    import ray
    import torch

    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job

    torch.set_num_threads(1)
    # the model actor keeps glibc's freed step temporaries (host_memory.py); the engine alone
    # runs in this process, so it gets the same heap (without it its first run was ~15 % slower
    # than its second, the heap's dynamic thresholds warming up over the run)
    from vlbatch.operators.engine.host_memory import retain_freed_memory

    retain_freed_memory()
    work = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    model = make_model(args.model, work)
    if args.videos:
        from benchmarks.pipeline_video import main as video_main

        return video_main(args, work, model)
    media = make_inputs(work, args.media)
    questions = [f"Question {k}: what is in the picture?" for k in range(args.questions)]
    manifest = work / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"media_uri": m, "qs": questions}) + "\n" for m in media))
    cfg = validate_config(job_dict(model, manifest, work / "out", args))
    ray.init(include_dashboard=False, log_to_driver=False)  # a running cluster, as in production
    reqs = engine_requests(cfg, media, questions)
    eng = [engine_alone(cfg, reqs)]
    from benchmarks.startup_cpu import StartupCpu

    with StartupCpu() as probe:  # CPU seconds per process until the model actor is ready
        t0 = time.perf_counter()
        summary = run_job(cfg)
        pipe_wall = time.perf_counter() - t0
    off, off_wall = None, None
    if not args.skip_metrics_off:  # the same job, metrics off, its own output
        off_cfg = validate_config({**job_dict(model, manifest, work / "out_off", args), "ray": {"metrics": False}})
        t0 = time.perf_counter()
        off = run_job(off_cfg)
        off_wall = time.perf_counter() - t0
    base = None if args.skip_baseline else baseline(model, media[: args.baseline_media], questions, args)
    ray.shutdown()
    eng.append(engine_alone(cfg, reqs))
    report(args, model, len(reqs), eng, summary, pipe_wall, base)
    occupancy_report(summary, pipe_wall, off, off_wall)
    print(probe.report(summary.model_ready_after_s))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))  # `python benchmarks/bench_pipeline.py` from anywhere
    main()
