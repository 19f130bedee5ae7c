"""Video decoding benchmark: sampled frames/s at 2 fps and peak RSS, ours vs transformers.

    flock /work/bench.lock python3 -m benchmarks.bench_video_decode [--cache DIR] [--fps 2]
        [--clips 720p_60s 480p_10min 1080p_30s 4k_10s] [--methods ...] [--big]

Clips (generated once into the cache dir, H.264 High with B-frames, GOP 250, 25 fps,
low-complexity content whose frames carry their index): 60 s 1280x720, 10 min 854x480,
30 s 1920x1080 and 10 s 3840x2160. Every sampled frame is decoded (`max_frames` lifted), so each
method returns the same number of frames: int(total / 25 * fps).

Methods, each in its own child process (so peak RSS is per method):
- decord:        our decord backend in process (`decode_video_inprocess`, 1 thread)
- pyav-full:     our PyAV backend decoding every picture (`skip_nonref=False`: before issue 35)
- pyav:          our PyAV backend (1 thread), non-reference pictures between samples not decoded
- torchcodec:    our TorchCodec backend (exact seek mode: its own packet scan, frames by index)
- torchcodec-approx: TorchCodec's approximate seek mode, frames by index (as vLLM uses it):
                 no scan, timestamps from the average rate; `ok` shows whether the frames are right
- torchcodec-cuda: `video.decode_device: cuda`'s decode (`operators/media/gpu_decode.decode_on_device`,
                 NVDEC; frames left on the GPU, synchronised); not in the default list (needs a GPU)
- decord+worker, pyav+worker, torchcodec+worker: the production path: the backend in the killable
                 `DecodeWorker` child (frames handed over through its shared-memory ring), started and
                 warm before the clock starts, as one child serves many videos in a CPU actor (its
                 start is printed apart, `start cpu`); RSS and CPU = parent + child (the child's
                 CPU read from /proc while it is alive). The ratio line per clip (`paired`): the
                 worker's CPU over the same backend's in-process CPU, medians of `--pairs` rounds side
                 by side in one process (issue 54's target: <= 1.15 for pyav and torchcodec), with the
                 parent's and the child's shares and each side's range; `--no-thp` runs those rounds
                 with transparent huge pages off (prctl PR_SET_THP_DISABLE, inherited by the child):
                 on a VM the first touch of a fresh huge page costs anything from 0.1 to 2.5 s per
                 1.5 GB of frames, on both sides, which hides a 15 % difference; 4 KB pages cost more
                 but the same every time
- pyav+worker-file: the decode stage's path for a local file (issue 60, item 15): `storage.open_media` opens
                 and checks it, the child reads it through its descriptor; the parent never reads the bytes
                 (`+worker` above passes bytes the caller read, written once into a sealed memfd: shared
                 memory that no RSS shows, so its RSS misses one copy)
- transformers:  `transformers.video_utils.load_video(path, fps=fps)` with its default
                 backend (PyAV), the reference's loading path
`ok` is the fraction of returned frames whose embedded index equals the index the
method claims to have sampled. Ratios are frames/s over transformers'. `cpu s` is
user + system CPU time of the decode (less sensitive than wall time to other load on
a shared machine; frames/s is wall-clock); `cpu x ref` is transformers' CPU seconds over the
method's (above 1: less CPU than the reference); `cpu x decord` the same against our decord backend.
`--big`: instead of the clips, a 24 s 1080p MJPEG with noise (about 440 MB, the size of issue 60's video)
with the worker methods and pyav, to compare the process tree's peak RSS with the file's size.
A last line measures per-call overhead of the worker on a 1 s 160x96 clip. `--repeat N` runs every
method N times (each in a fresh process) and keeps the run with the least CPU (the least disturbed
by other load on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CLIPS = {"720p_60s": (1280, 720, 60), "480p_10min": (854, 480, 600), "1080p_30s": (1920, 1080, 30),
         "4k_10s": (3840, 2160, 10)}
CLIP_FPS = 25
METHODS = ("decord", "pyav-full", "pyav", "torchcodec", "torchcodec-approx", "decord+worker", "pyav+worker",
           "pyav+worker-file", "torchcodec+worker", "transformers")
BIG = ("big_1080p_mjpeg", 1920, 1080, 24)  # --big: (name, width, height, seconds); noise makes it ~440 MB
BIG_METHODS = ("pyav", "pyav+worker", "pyav+worker-file")
BACKEND_OF = {"pyav-full": "benchmarks.bench_video_decode:PyAVFull"}  # method -> get_decoder name


def _pyav_full():
    from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder

    class PyAVFull(PyAVDecoder):
        """PyAV decoding every picture (the backend before issue 35's sparse skipping)."""

        def __init__(self, threads: int = 1):
            super().__init__(threads, skip_nonref=False)

    return PyAVFull


def __getattr__(name):  # get_decoder("benchmarks.bench_video_decode:PyAVFull") without importing av here
    if name == "PyAVFull":
        return _pyav_full()
    raise AttributeError(name)


def torchcodec_approx(data: bytes, sampling):
    """TorchCodec approximate mode, frames by index over its header metadata: ([F, H, W, 3], indices)."""
    from torchcodec.decoders import VideoDecoder

    dec = VideoDecoder(data, seek_mode="approximate", dimension_order="NHWC", num_ffmpeg_threads=1)
    meta = dec.metadata
    from vlbatch.operators.media.decoders import VideoInfo

    info = VideoInfo(fps=meta.average_fps, frames=meta.num_frames, header_frames=meta.num_frames,
                     duration_s=meta.duration_seconds, width=meta.width, height=meta.height, rotation=0, codec="")
    indices = [int(i) for i in sampling.indices(info)]
    return dec.get_frames_at(indices).data.numpy(), indices


def make_clip(path: Path, width: int, height: int, seconds: int, offset: int = 0, big: bool = False) -> None:
    """Encode the benchmark clip straight from YUV planes (cheap to generate; written via a temp name).
    offset: frame i carries index i + offset (distinct clips for bench_pipeline's video mode);
    big: MJPEG at its best quality with noise in the lower half (`--big`: a file of hundreds of MB)."""
    import av
    import numpy as np

    tmp = path.with_suffix(".part.mp4")
    out = av.open(str(tmp), "w")
    stream = out.add_stream("mjpeg" if big else "libx264", rate=CLIP_FPS)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuvj420p" if big else "yuv420p"
    stream.options = {"qmin": "1", "qmax": "1"} if big else {"preset": "ultrafast", "bf": "2", "g": "250", "crf": "30"}
    if big:
        stream.bit_rate = 400_000_000  # with qmin = qmax = 1: every frame at its best quality
    noise = np.random.default_rng(0)
    base = np.empty((height * 3 // 2, width), np.uint8)
    base[:height], base[height:] = 24, 128
    bw, bh, side = width // 8, height // 4, height // 6
    for j in range(seconds * CLIP_FPS):
        y, i = base.copy(), j + offset
        for b in range(16):  # the same bit layout as vlbatch.devtools.samples.index_pattern
            if (i >> b) & 1:
                r, c = divmod(b, 8)
                y[r * bh:(r + 1) * bh, c * bw:(c + 1) * bw] = 232
        x = (i * 5) % (width - side)
        y[height // 2 + 2:height // 2 + 2 + side, x:x + side] = 160
        if big:
            top = height // 2 + side + 4
            y[top:height] = noise.integers(0, 256, (height - top, width), np.uint8)
        for packet in stream.encode(av.VideoFrame.from_ndarray(y, format="yuv420p")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    tmp.rename(path)


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def child_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a live child (/proc/PID/stat utime, stime; clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def worker_decode(path: str, sampling, backend: str, as_file: bool = False) -> tuple[object, float, dict]:
    """The production path, warm: (clip, wall s, {"cpu": parent + child CPU s for the decode, "parent_cpu",
    "child_cpu", "start_cpu": the child's start}). as_file: the file handed over (`storage.open_media`),
    else its bytes read by the caller, inside the clock, as the stage did before issue 60."""
    from vlbatch.operators.media.worker import DecodeWorker

    with DecodeWorker(timeout_s=3600, preload=backend) as w:
        w.start()  # imports and the decoder's library before "ready", as a CPU actor's child has long done
        start = child_cpu_seconds(w.pid)
        cpu, t = own_cpu_seconds(), time.perf_counter()
        if as_file:
            from vlbatch.operators.storage import open_media

            with open_media(path) as media:
                clip = w.decode(media, sampling, backend)
        else:
            clip = w.decode(Path(path).read_bytes(), sampling, backend)
        seconds = time.perf_counter() - t
        parent, kid = own_cpu_seconds() - cpu, child_cpu_seconds(w.pid) - start
    return clip, seconds, {"cpu": parent + kid, "parent_cpu": parent, "child_cpu": kid, "start_cpu": start}


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + kids) / 1024


def run_one(method: str, path: str, fps: float) -> dict:
    """Child side: decode once, report time, frames, correctness and peak RSS."""
    import numpy as np

    from vlbatch.devtools.samples import frame_index
    from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess

    sampling = FrameSampling(fps=fps, max_frames=10**7)
    import av  # noqa: F401 - imported before timing, as the worker child does before "ready"
    import decord  # noqa: F401
    if method.startswith("torchcodec"):  # imported before timing, as the worker child does before "ready"
        import torchcodec.decoders  # noqa: F401
        if method == "torchcodec-cuda":  # the model actor's CUDA context exists before any video
            import torch

            torch.zeros(1, device="cuda")
    base_rss = peak_rss_mb()
    cpu = cpu_seconds()
    t = time.perf_counter()
    if method == "transformers":
        from transformers.video_utils import load_video

        frames, meta = load_video(path, fps=fps)
        indices = list(meta.frames_indices)
    elif method == "torchcodec-approx":
        frames, indices = torchcodec_approx(Path(path).read_bytes(), sampling)
    elif method == "torchcodec-cuda":
        import torch

        from vlbatch.operators.media.gpu_decode import decode_on_device

        clip = decode_on_device(Path(path).read_bytes(), sampling, "cuda")
        torch.cuda.synchronize()
        done = time.perf_counter()  # wall time ends here: the frames' copy to the host below is for `ok` only
        frames, indices = clip.frames.cpu().numpy(), list(clip.indices)
    elif "+worker" in method:
        clip, seconds, shares = worker_decode(path, sampling, method.split("+")[0], method.endswith("-file"))
        frames, indices = clip.frames, list(clip.indices)
    else:
        clip = decode_video_inprocess(Path(path).read_bytes(), sampling, BACKEND_OF.get(method, method))
        frames, indices = clip.frames, list(clip.indices)
    if "+worker" not in method:
        seconds = (done if method == "torchcodec-cuda" else time.perf_counter()) - t
        cpu = cpu_seconds() - cpu
    else:
        cpu = shares["cpu"]
    ok = float(np.mean([frame_index(f) == (i % 65536) for f, i in zip(frames, indices, strict=True)]))
    return {"frames": len(indices), "seconds": seconds, "cpu": cpu, "ok": ok, "rss_mb": peak_rss_mb(),
            "rss_before_mb": base_rss, "shape": list(frames.shape[1:]),
            **(shares if "+worker" in method else {})}


def overhead() -> dict:
    """Per-call cost of the worker vs in-process on a tiny clip (mean of 20 calls after warm-up)."""
    import tempfile

    from vlbatch.devtools.samples import encode_video
    from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess
    from vlbatch.operators.media.worker import DecodeWorker

    with tempfile.TemporaryDirectory() as d:
        encode_video(Path(d) / "t.mp4", 25, 160, 96, 25, options={"bf": "2"})
        data = (Path(d) / "t.mp4").read_bytes()
    sampling = FrameSampling(fps=2)
    decode_video_inprocess(data, sampling, "decord")
    t = time.perf_counter()
    for _ in range(20):
        decode_video_inprocess(data, sampling, "decord")
    inproc = (time.perf_counter() - t) / 20
    with DecodeWorker(timeout_s=60) as w:
        t = time.perf_counter()
        w.decode(data, sampling, "decord")
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(20):
            w.decode(data, sampling, "decord")
        warm = (time.perf_counter() - t) / 20
    return {"inprocess_ms": inproc * 1e3, "worker_first_call_ms": first * 1e3, "worker_warm_ms": warm * 1e3}


def best_of(args: list[str], repeat: int) -> dict:
    """The run with the least CPU of `repeat` fresh-process runs (an error if any failed)."""
    runs = [child(args) for _ in range(repeat)]
    return next((r for r in runs if "error" in r), None) or min(runs, key=lambda r: r["cpu"])


def child(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_video_decode", "--child", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def paired(backend: str, path: str, fps: float, rounds: int, thp: bool = True) -> dict:
    """Child side of the ratio line: one process, one warm worker, `rounds` rounds of the same decode in-process
    and in the worker (the order alternating), medians of CPU s. Why paired: one in-process decode of the same
    video costs 0.66-1.31 CPU s from run to run on a VM, by how cold the fresh output pages are at the host, so
    two fresh processes' figures cannot show a 15 % difference; medians of rounds side by side can. thp False:
    transparent huge pages off for this process and the worker's child (see the module's `--no-thp`)."""
    import ctypes
    import statistics

    if not thp and ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0) != 0:  # PR_SET_THP_DISABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")

    from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess

    data, sampling = Path(path).read_bytes(), FrameSampling(fps=fps, max_frames=10**7)
    if backend == "torchcodec":
        import torchcodec.decoders  # noqa: F401 - imported before timing, as the worker child does before "ready"
    from vlbatch.operators.media.worker import DecodeWorker

    inproc, parent, kid = [], [], []
    with DecodeWorker(timeout_s=3600, preload=backend) as w:
        w.decode(data, FrameSampling(fps=0.1), backend)  # both warm: libraries loaded, first decoder built
        decode_video_inprocess(data, FrameSampling(fps=0.1), backend)
        for r in range(rounds):
            for side in ("inproc", "worker") if r % 2 == 0 else ("worker", "inproc"):
                cpu, child = own_cpu_seconds(), child_cpu_seconds(w.pid)
                if side == "inproc":
                    decode_video_inprocess(data, sampling, backend)
                    inproc.append(own_cpu_seconds() - cpu)
                else:
                    frames = w.decode(data, sampling, backend).frames
                    parent.append(own_cpu_seconds() - cpu)
                    kid.append(child_cpu_seconds(w.pid) - child)
                    del frames
    both = [p + k for p, k in zip(parent, kid, strict=True)]
    ratios = [b / i for b, i in zip(both, inproc, strict=True)]
    return {"inproc": statistics.median(inproc), "worker": statistics.median(both), "parent": statistics.median(parent),
            "child": statistics.median(kid), "ratio": statistics.median(ratios),
            "spread": [round(min(inproc), 2), round(max(inproc), 2), round(min(both), 2), round(max(both), 2)]}


def print_worker_ratios(clip: str, path: Path, fps: float, methods: list[str], rounds: int, thp: bool) -> None:
    """One line per clip: each backend's worker CPU over its in-process CPU (issue 54: <= 1.15 for pyav and
    torchcodec), paired in one process (`paired`): the median ratio, the medians of in-process, parent and child
    CPU s, and the range of each side."""
    parts = []
    for backend in ("pyav", "torchcodec", "decord"):
        if backend in methods and f"{backend}+worker" in methods:
            r = child(["paired", backend, str(path), str(fps), str(rounds), "thp" if thp else "no-thp"])
            if "error" in r:
                parts.append(f"{backend} error: {r['error']}")
                continue
            lo, hi, wlo, whi = r["spread"]
            parts.append(f"{backend} {r['ratio']:.2f}x (in-process {r['inproc']:.2f} s [{lo}-{hi}]; worker "
                         f"{r['worker']:.2f} s [{wlo}-{whi}] = parent {r['parent']:.2f} + child {r['child']:.2f})")
    if parts:
        pages = "" if thp else ", huge pages off"
        print(f"{clip:11s} worker cpu / in-process cpu, medians of {rounds} paired rounds{pages}: " + "; ".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/vlbatch/bench_video"))
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--clips", nargs="+", default=list(CLIPS), choices=list(CLIPS))
    p.add_argument("--no-overhead", action="store_true", help="skip the per-call overhead line")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=[*METHODS, "torchcodec-cuda"])
    p.add_argument("--repeat", type=int, default=1, help="runs per method; the least CPU is kept")
    p.add_argument("--pairs", type=int, default=9, help="rounds of the paired worker / in-process ratio line")
    p.add_argument("--no-thp", action="store_true", help="the paired rounds with transparent huge pages off")
    p.add_argument("--big", action="store_true", help="only the ~440 MB clip (peak RSS vs file size), "
                   "methods " + ", ".join(BIG_METHODS))
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        if a.child[0] == "paired":
            result = paired(a.child[1], a.child[2], float(a.child[3]), int(a.child[4]), a.child[5] == "thp")
        else:
            result = overhead() if a.child[0] == "overhead" else run_one(a.child[0], a.child[1], float(a.child[2]))
        print(json.dumps(result))
        return
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    print(f"video decode benchmark: sampling {a.fps:g} fps, every sampled frame decoded; cache {cache}")
    print(f"{'clip':11s} {'method':18s} {'frames':>6s} {'wall s':>7s} {'cpu s':>7s} {'frames/s':>9s} {'x ref':>6s} "
          f"{'cpu x ref':>9s} {'cpu x decord':>12s} {'peak RSS MB':>11s} {'x ref':>6s} {'ok':>5s}")
    clips = {BIG[0]: BIG[1:]} if a.big else {name: CLIPS[name] for name in a.clips}
    methods = BIG_METHODS if a.big else a.methods
    for name, (w, h, secs) in clips.items():
        path = cache / f"{name}.mp4"
        if not path.exists():
            t = time.perf_counter()
            make_clip(path, w, h, secs, big=a.big)
            print(f"  generated {path} ({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t:.0f} s")
        if a.big:
            print(f"  {path.name}: {path.stat().st_size / 2**20:.0f} MiB")
        results = {m: best_of([m, str(path), str(a.fps)], a.repeat) for m in methods}
        ref = results.get("transformers", {})
        base = results.get("decord", {})
        for m, r in results.items():
            if "error" in r:
                print(f"{name:11s} {m:18s} error: {r['error']}")
                continue
            fps = r["frames"] / r["seconds"]
            speed = f"{fps / (ref['frames'] / ref['seconds']):.2f}" if "seconds" in ref else "-"
            mem = f"{r['rss_mb'] / ref['rss_mb']:.2f}" if "rss_mb" in ref else "-"
            cpu = f"{ref['cpu'] / r['cpu']:.2f}" if "cpu" in ref else "-"
            vs_decord = f"{base['cpu'] / r['cpu']:.2f}" if "cpu" in base else "-"
            print(f"{name:11s} {m:18s} {r['frames']:6d} {r['seconds']:7.2f} {r['cpu']:7.2f} {fps:9.1f} {speed:>6s} "
                  f"{cpu:>9s} {vs_decord:>12s} {r['rss_mb']:11.0f} {mem:>6s} {r['ok']:5.2f}")
        if not a.big:
            print_worker_ratios(name, path, a.fps, a.methods, a.pairs, not a.no_thp)
    o = {"error": "skipped"} if a.no_overhead else child(["overhead"])
    if "error" not in o:
        print(f"per-call overhead, 1 s 160x96 clip: in-process {o['inprocess_ms']:.1f} ms, worker warm "
              f"{o['worker_warm_ms']:.1f} ms, worker first call (process start) {o['worker_first_call_ms']:.0f} ms")


if __name__ == "__main__":
    main()
