"""bench_pipeline's video mode (`--videos N`): the whole pipeline on N videos, once per decoder.

    flock /work/bench.lock python benchmarks/bench_pipeline.py --videos 6 [--video-seconds 60]
        [--decoders decord pyav torchcodec] [--model tiny]

N distinct 854x480 H.264 clips (B-frames, GOP 250, 25 fps; bench_video_decode's generator, each clip's
frame numbers offset so no two are alike), one caption request each, sampled at 2 fps with every sampled
frame kept (`max_frames` lifted) and resized to `--video-max-pixels` per frame so the model stage stays
small beside the decode. The same job runs once per decoder (`video.decoder`), each with its own output,
on one local Ray. Printed per decoder: end-to-end wall and rows/s, the decode stage's busy seconds
(summed per media: read + probe + decode in the killable child + transfer), the CPU seconds of the
decoder children (summed from /proc over the run), and the ratios against the first decoder.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

CHILD = "vlbatch.operators.media.worker"


def make_videos(work: Path, n: int, seconds: int) -> list[str]:
    from benchmarks.bench_video_decode import make_clip

    out = []
    (work / "vid").mkdir(parents=True, exist_ok=True)
    for k in range(n):
        path = work / "vid" / f"clip{k:03d}.mp4"
        make_clip(path, 854, 480, seconds, offset=k * 7919)
        out.append(str(path))
    return out


def job_dict(model: str, manifest: Path, out: Path, decoder: str, args) -> dict:
    return {
        "model": {"path": model, "dtype": "float32", "device": "auto"},
        "input": {"uri": str(manifest), "format": "jsonl", "columns": {"media_type": None}},
        "task": {"mode": "caption", "video_prompt": "Describe the video."},
        "sampling": {"max_tokens": args.max_tokens},
        "video": {"decoder": decoder, "fps": 2.0, "max_frames": 100000, "max_pixels": args.video_max_pixels,
                  "decode_timeout_s": 600},
        "resources": {"fuse_cpu_stages": True,
                      "preprocess": {"num_cpus": 0.5, "batch_size": 1, "max_actors": 1},
                      "model": {"num_cpus": 1, "num_gpus": args.gpus, "batch_size": 4,
                                "max_concurrent_batches": 4, "batch_visual_tokens": 1 << 20},
                      "write": {"num_cpus": 0.25, "batch_size": 8, "max_actors": 1}},
        "output": {"uri": str(out), "run_id": "bench"}, "max_error_fraction": 0.0,
    }


class ChildCpu:
    """Sums the CPU seconds of decoder children (`python -m vlbatch.operators.media.worker`) seen in /proc,
    polled every 0.2 s (a child's last 0.2 s before exit may be missed; children live for the whole run)."""

    def __init__(self):
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if CHILD not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        continue
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                self.seen[int(pid)] = (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime

    def __enter__(self) -> ChildCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        return sum(self.seen.values())


def main(args, work: Path, model: str) -> None:
    import ray

    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job

    videos = make_videos(work, args.videos, args.video_seconds)
    manifest = work / "videos.jsonl"
    manifest.write_text("".join(json.dumps({"media_uri": v}) + "\n" for v in videos))
    ray.init(include_dashboard=False, log_to_driver=False)
    results = {}
    for decoder in args.decoders:
        cfg = validate_config(job_dict(model, manifest, work / f"out-{decoder}", decoder, args))
        with ChildCpu() as cpu:
            t0 = time.perf_counter()
            summary = run_job(cfg)
            wall = time.perf_counter() - t0
        ok = summary.committed_by_status.get("ok", 0)
        results[decoder] = {"wall": wall, "ok": ok, "decode": summary.stage_seconds.get("decode", 0.0),
                            "cpu": cpu.seconds, "model": summary.stage_seconds.get("model", 0.0)}
    ray.shutdown()
    print(f"videos: {args.videos} x {args.video_seconds} s 854x480 H.264 (GOP 250, B-frames), 2 fps, every sampled "
          f"frame, {args.video_max_pixels} pixels per frame, model {args.model}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"  {'decoder':12s} {'rows ok':>7s} {'wall s':>7s} {'rows/s':>7s} {'decode busy s':>13s} "
          f"{'decoder CPU s':>13s} {'model busy s':>12s} {'wall x':>7s} {'decode x':>8s} {'cpu x':>6s}")
    first = results[args.decoders[0]]
    for d, r in results.items():
        print(f"  {d:12s} {r['ok']:7d} {r['wall']:7.1f} {r['ok'] / r['wall']:7.3f} {r['decode']:13.1f} "
              f"{r['cpu']:13.1f} {r['model']:12.1f} {first['wall'] / r['wall']:7.2f} "
              f"{first['decode'] / max(r['decode'], 1e-9):8.2f} {first['cpu'] / max(r['cpu'], 1e-9):6.2f}")
    print(f"  x columns: {args.decoders[0]}'s figure over each decoder's (above 1: faster / less CPU)")
