"""GPU video decode (`video.decode_device: cuda`) against the CPU stage's decode, on generated clips.

    python3 -m benchmarks.gpu_decode --device cuda [--clips 720p_60s 1080p_30s 4k_10s] [--json OUT]
    python3 -m benchmarks.gpu_decode --device cpu --clips tiny     # gpu_run.sh --rehearse

Per clip (bench_video_decode's generated clips: H.264 High with B-frames, GOP 250, 25 fps; `tiny`:
2 s of 160x96), sampled at `--fps` (default 2, every sampled frame, `max_frames` lifted), resized
to the default Qwen3.5 video budget, the two routes to the frames the engine gets:

- cpu:      the CPU stage's decode (`decode_video_inprocess` with `--backend`, default auto) then
            its resize (`visual._resized`): what `video.decode_device: cpu` ships;
- deferred: the plan (`decode_stream`'s first plan: the shared PyAV probe, no frame decoded), then
            the model stage's `DecodePlan.frames` on `--device`: TorchCodec there (NVDEC on cuda),
            the frames back on the host for the CPU path's resize (bit-exact resize).

Each prints wall s and this process's CPU s (user + system), frames/s, and the ratios deferred
over cpu; `identical` says whether the deferred frames equal the CPU stage's bit for bit
(on cuda NVDEC's colour conversion may differ from swscale: `max_abs_diff` and the share of
equal bytes say by how much). Where `--device` cannot decode (`decode_device_problem`: no CUDA,
no TorchCodec or FFmpeg libraries) it writes `{"skipped": why}` and exits 0: the run's other
steps stand. Not a test: nothing is asserted here (tests/test_gpu_run.py checks the rehearsal's).
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

CLIPS = {"tiny": (160, 96, 2)}  # besides bench_video_decode.CLIPS


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn, sync=None) -> tuple[object, dict]:
    c0, t0 = cpu_s(), time.perf_counter()
    out = fn()
    if sync is not None:
        sync()
    return out, {"wall_s": round(time.perf_counter() - t0, 4), "cpu_s": round(cpu_s() - c0, 4)}


def measure(data: bytes, device: str, fps: float, backend: str) -> dict:
    """Both routes on one clip: timings, frames and how equal they are."""
    import numpy as np
    import torch

    from vlbatch.operators.media.video import FrameSampling, Plan, decode_stream, decode_video_inprocess
    from vlbatch.operators.preprocess.config import VideoConfig
    from vlbatch.operators.preprocess.shipped import DecodePlan
    from vlbatch.operators.preprocess.visual import _resized, plan_video
    from vlbatch.operators.types import VideoPlan

    sampling = FrameSampling(fps=fps, max_frames=1 << 20)
    cfg = VideoConfig()
    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    def plan_of():
        plan = next(item for item in decode_stream(data, sampling, "pyav") if isinstance(item, Plan))
        vp = VideoPlan(plan.info.fps, plan.info.frames, plan.indices, plan.info.height, plan.info.width)
        size, batch = plan_video(vp, cfg)
        return DecodePlan.of(plan.indices, plan.info.frames, batch.grid_thw[0], cfg.layout), size

    def cpu_route():
        clip = decode_video_inprocess(data, sampling, backend)
        return np.ascontiguousarray(_resized(clip.frames, size))

    (plan, size), t_plan = timed(plan_of)
    # TorchCodec's import, FFmpeg's libraries, the CUDA context and NVDEC: once per process, not the clip's
    DecodePlan(plan.indices[:1], plan.total_frames, size).frames(data, device)
    ref, t_cpu = timed(cpu_route)
    got, t_dev = timed(lambda: plan.frames(data, device), sync)
    got = got.numpy()
    n = len(plan.indices)
    diff = np.abs(got.astype(np.int16) - ref.astype(np.int16)) if got.shape == ref.shape else None
    t_def = {k: round(t_plan[k] + t_dev[k], 4) for k in t_plan}
    return {"frames": n, "size": list(size), "plan": t_plan, "cpu": t_cpu, "deferred": t_def,
            "cpu_fps": round(n / max(t_cpu["wall_s"], 1e-9), 1),
            "deferred_fps": round(n / max(t_def["wall_s"], 1e-9), 1),
            "wall_x_cpu": round(t_cpu["wall_s"] / max(t_def["wall_s"], 1e-9), 2),
            "cpu_s_x_cpu": round(t_cpu["cpu_s"] / max(t_def["cpu_s"], 1e-9), 2),
            "identical": diff is not None and not diff.any(),
            "max_abs_diff": None if diff is None else int(diff.max()),
            "equal_bytes": None if diff is None else round(float((diff == 0).mean()), 6)}


def main(argv=None) -> int:
    from benchmarks.bench_video_decode import CLIPS as BENCH_CLIPS
    from benchmarks.bench_video_decode import make_clip

    clips = {**CLIPS, **BENCH_CLIPS}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="where the deferred route decodes: cuda, cuda:N or cpu")
    ap.add_argument("--clips", nargs="+", default=["720p_60s", "1080p_30s", "4k_10s"], choices=list(clips))
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--backend", default="auto", help="the CPU stage's decoder (video.decoder)")
    ap.add_argument("--cache", default="/tmp/vlbatch-gpu-decode", help="folder of the generated clips")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from vlbatch.operators.media.gpu_decode import decode_device_problem

    report: dict = {"device": args.device, "fps": args.fps, "backend": args.backend, "clips": {}, "skipped": None}
    why = None if args.device == "cpu" else decode_device_problem(args.device, "cuda")
    if why is not None:
        report["skipped"] = why
        print(f"gpu_decode skipped: {why}")
    else:
        cache = Path(args.cache)
        cache.mkdir(parents=True, exist_ok=True)
        for name in args.clips:
            path = cache / f"{name}.mp4"
            if not path.exists():
                make_clip(path, *clips[name])
            r = report["clips"][name] = measure(path.read_bytes(), args.device, args.fps, args.backend)
            print(f"{name:>10}: {r['frames']} frames -> {r['size'][1]}x{r['size'][0]} | cpu {r['cpu']['wall_s']:.3f} s "
                  f"wall, {r['cpu']['cpu_s']:.3f} CPU s | deferred on {args.device} "
                  f"{r['deferred']['wall_s']:.3f} s wall, "
                  f"{r['deferred']['cpu_s']:.3f} CPU s (plan {r['plan']['wall_s']:.3f} s) | wall x{r['wall_x_cpu']}, "
                  f"CPU s x{r['cpu_s_x_cpu']} | identical {r['identical']} (max diff {r['max_abs_diff']}, "
                  f"equal bytes {r['equal_bytes']})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
