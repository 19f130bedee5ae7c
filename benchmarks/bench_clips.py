"""Video clips benchmark (issue 51): bounded memory of a long video, and one decode vs cut-then-caption.

    python -m benchmarks.bench_clips [--cache DIR] [--long-hours 2 --long-fps 2] [--minutes 10 --fps 30]
        [--parts rss,compare] [--clip-files]

Videos (generated once into the cache dir, H.264 ultrafast, a hard cut every 7 s, a moving square): a
`--long-hours` 854x480 video at `--long-fps` of solid scenes (low rate and plain, to keep it small on
disk) and a `--minutes` 1280x720 video at `--fps` of panning random textures (real work for the codec).

rss: the long video through the CPU stage's clip work in 10 s windows (`DecodeWorker.decode_clips`, fixed
    windows, decoded in the killable decoder child as the CPU stage does, every clip preprocessed by our
    `Processor` of the bundled shapes-tiny checkpoint), in a child process; the peak RSS of its process
    tree printed (target < 1.5 GiB): the process's peak + the decoder child's peak (an upper bound of the
    tree's peak; each one's VmHWM).
compare: the 720p video in 10 s windows, each path in its own child process (CPU s = user + system of
    that process, wall s):
    - vlbatch: one decode (`DecodeWorker.decode_clips`, fixed: in the decoder child, as the CPU stage
      does), each clip sampled at 2 fps and preprocessed; CPU s include the decoder child's;
    - scenes:  the same with `mode: scenes` (the content detector on every frame); detection's share
      of its CPU stage (the CPU in scaling pictures for the detector and in its score, timed around
      `clip_decode._State._detect` in the decoder child, over the CPU of both processes) printed
      (target <= 15 %);
    - cut-then-caption: what users do today: cut the file into 10 s clip files with PyAV (decode and
      re-encode, libx264 veryfast), then each clip file as a whole-video media (`clips.mode: none`:
      `decode_video_inprocess` at 2 fps + the same preprocess).
    - with `--clip-files`: vlbatch one decode again, the decoder child also writing every clip as a file
      (`output.clip_files` defaults: mp4, libx264 crf 23 veryfast, `operators/media/clip_files.py`) into the
      worker's temp folder and this process storing it (`store_clip`, to a temp folder); the extra CPU s over
      the plain one-decode run printed, and the CPU inside the child's writer.
    The model is left out of both (same clips, same frames, same tokens to it in either path): this
    compares the CPU-stage work, where the two paths differ. Ratio: cut-then-caption CPU / vlbatch CPU
    (target >= 2x).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

WINDOW_S = 10.0
SCENE_S = 7.0


def _texture(k: int, width: int, height: int, plain: bool = False):
    """Scene k's background: a blocky random texture in its own colours (one colour with `plain`),
    twice the frame's width."""
    import numpy as np

    rng = np.random.default_rng(k)
    if plain:
        return np.broadcast_to(rng.integers(20, 235, 3, dtype=np.uint8), (height, 2 * width, 3))
    small = rng.integers(0, 256, (height // 16 + 1, width // 8 + 1, 3), dtype=np.uint8)
    big = np.repeat(np.repeat(small, 16, axis=0), 16, axis=1)[:height, : 2 * width]
    tint = rng.integers(40, 200, 3, dtype=np.uint8)
    return (big // 2 + tint // 2).astype(np.uint8)


def _frame(tex, i: int, width: int, height: int):
    """The texture panning 3 px a frame (real motion for the codec) and a moving square. The pan starts
    over every `width / 3` frames: a jump in content the scene detector rightly counts as a cut too."""
    x0 = (i * 3) % width
    img = tex[:, x0: x0 + width].copy()
    s = height // 6
    x = (i * 5) % (width - s)
    img[height // 3: height // 3 + s, x: x + s] = 255 - img[0, 0]
    return img


def make_video(path: Path, seconds: float, fps: float, width: int, height: int, plain: bool = False) -> Path:
    """Encode the benchmark video once (kept in the cache); `plain`: solid scenes (small on disk)."""
    if path.exists():
        return path
    import av

    n = int(seconds * fps)
    tmp = path.with_suffix(".tmp.mp4")
    with av.open(str(tmp), "w") as out:
        stream = out.add_stream("libx264", rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": str(int(fps * 5))}
        tex, scene = None, None
        for i in range(n):
            k = int(i / fps / SCENE_S)
            if k != scene:
                tex, scene = _texture(k, width, height, plain), k
            frame = av.VideoFrame.from_ndarray(_frame(tex, i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    tmp.rename(path)
    return path


def _processor():
    from vlbatch.models import SHAPES_TINY
    from vlbatch.operators.preprocess import Processor

    return Processor.from_pretrained(str(SHAPES_TINY))


def _store_files(folder: str):
    """`decode_clips`' `clip_files` + `on_file` storing each clip file the child wrote under `folder`."""
    from vlbatch.operators.media.clip_files import ClipFileSettings, ClipTarget, store_clip
    from vlbatch.operators.storage import StorageOptions

    target = ClipTarget(folder=folder, settings=ClipFileSettings(), storage=StorageOptions())

    def on_file(clip, file) -> None:
        if file.path is None:
            raise RuntimeError(f"clip {clip.index}: no clip file ({file.refused or file.failed})")
        store_clip(target, f"clip-{clip.index:05d}", file.path)

    return {"clip_files": target.settings, "on_file": on_file}


def run_vlbatch(path: str, mode: str) -> dict:
    """One decode: every clip of the video, decoded in the killable decoder child (its `child_argv`: this
    module's `--decode-child`, the real child timing its detector and clip writer), sampled and preprocessed;
    mode `files`: fixed windows, each clip also written as a clip file by the child."""
    import tempfile

    from vlbatch.operators.media.clips import ClipRule
    from vlbatch.operators.media.video import FrameSampling
    from vlbatch.operators.media.worker import DecodeWorker

    proc = _processor()
    data = Path(path).read_bytes()
    base = _rss_gib()  # imports, the processor and the video's bytes, before any frame
    clips = tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "detect.json"
        argv = [sys.executable, "-m", "benchmarks.bench_clips", "--decode-child", str(report)]
        files = _store_files(str(Path(tmp) / "clips")) if mode == "files" else {}
        rule = ClipRule(mode="fixed" if mode == "files" else mode, window_s=WINDOW_S)
        with DecodeWorker(timeout_s=600, child_argv=argv) as worker:
            for _clip, vc in worker.decode_clips(data, rule, FrameSampling(fps=2.0), **files):
                media = proc.encode_media(videos=[vc], frames=True)
                tokens += int(media.arrays["video_grid_thw"][0].prod())
                clips += 1
            child_rss = _hwm_gib(worker.pid)  # the decoder child's own peak, before it exits
        spent = json.loads(report.read_text())  # the child wrote it as it exited (closed)
        file_mb = sum(f.stat().st_size for f in (Path(tmp) / "clips").iterdir()) / 2**20 if files else 0.0
    return {"clips": clips, "patches": tokens, "detect_s": spent["detect_s"], "write_s": spent["write_s"],
            "file_mb": file_mb, "base_rss_gib": base, "child_rss_gib": child_rss}


def _hwm_gib(pid: int | str = "self") -> float:
    """A process's peak RSS (VmHWM: of its own image; `ru_maxrss` of an exec'd child starts from its
    parent's, since the kernel keeps the pre-exec high-water mark)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) / 2**20


def decode_child(report: str, fds: list[str]) -> None:
    """The decoder child (`child.main`) with its detector and clip writer timed; writes their CPU s to `report`
    at exit."""
    from vlbatch.operators.media import clip_decode, clip_files
    from vlbatch.operators.media.child import main

    spent = {"detect_s": 0.0, "write_s": 0.0}

    def timed(inner, key):
        def run(*args, **kw):
            c0 = time.process_time()
            try:
                return inner(*args, **kw)
            finally:
                spent[key] += time.process_time() - c0
        return run

    # the detector's CPU: scaling the picture + PySceneDetect's score; the writer's: converting + encoding
    clip_decode._State._detect = timed(clip_decode._State._detect, "detect_s")
    clip_files.write_clip = timed(clip_files.write_clip, "write_s")
    main(["child", *fds])
    Path(report).write_text(json.dumps(spent))


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def run_cut_then_caption(path: str) -> dict:
    """Cut into 10 s clip files with PyAV (decode + re-encode), then each file as a whole video (child)."""
    import av

    from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess

    proc = _processor()
    files: list[bytes] = []
    with av.open(path) as src:
        vs = src.streams.video[0]
        fps = float(vs.average_rate)
        per = int(round(WINDOW_S * fps))
        buf, out, stream, n = None, None, None, 0
        for frame in src.decode(vs):
            if n % per == 0:
                if out is not None:
                    for p in stream.encode():
                        out.mux(p)
                    out.close()
                    files.append(buf.getvalue())
                buf = io.BytesIO()
                out = av.open(buf, "w", format="mp4")
                stream = out.add_stream("libx264", rate=int(round(fps)))
                stream.width, stream.height, stream.pix_fmt = vs.width, vs.height, "yuv420p"
                stream.options = {"preset": "veryfast"}
            frame.pts, frame.time_base = n % per, Fraction(1, int(round(fps)))
            for p in stream.encode(frame):
                out.mux(p)
            n += 1
        for p in stream.encode():
            out.mux(p)
        out.close()
        files.append(buf.getvalue())
    tokens = 0
    for data in files:
        vc = decode_video_inprocess(data, FrameSampling(fps=2.0), backend="pyav")
        media = proc.encode_media(videos=[vc], frames=True)
        tokens += int(media.arrays["video_grid_thw"][0].prod())
    return {"clips": len(files), "patches": tokens}


def child(method: str, path: str) -> None:
    """One path, measured: CPU s of this process and its reaped children (the decoder child); peak RSS of
    this process plus the decoder child's."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = run_cut_then_caption(path) if method == "cut" else run_vlbatch(path, method)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    me, child_rss = _hwm_gib(), out.get("child_rss_gib", 0.0)
    out.update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0 + kids.ru_utime + kids.ru_stime,
               child_cpu_s=kids.ru_utime + kids.ru_stime, self_rss_gib=me, child_rss_gib=child_rss,
               peak_rss_gib=me + child_rss)
    print(json.dumps(out))


def measure(method: str, path: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "benchmarks.bench_clips", "--child", method, str(path)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/vlbatch/bench_clips"))
    ap.add_argument("--long-hours", type=float, default=2.0)
    ap.add_argument("--long-fps", type=float, default=2.0)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--fps", type=float, default=30.0)
    ap.add_argument("--parts", default="rss,compare")
    ap.add_argument("--methods", default="fixed,scenes,cut", help="compare's paths (the ratio needs fixed and cut)")
    ap.add_argument("--clip-files", action="store_true",
                    help="compare: also the one-decode path writing clip files (output.clip_files), in the "
                         "decoder child; prints the extra CPU seconds")
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--decode-child", nargs=4, metavar=("REPORT", "REQ", "RES", "RING"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(*a.child)
    if a.decode_child:
        return decode_child(a.decode_child[0], a.decode_child[1:])
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    if "rss" in parts:
        long = make_video(cache / f"long_{a.long_hours:g}h_480p_{a.long_fps:g}fps.mp4", a.long_hours * 3600,
                          a.long_fps, 854, 480, plain=True)
        r = measure("fixed", long)
        print(f"rss: {a.long_hours:g} h 854x480 at {a.long_fps:g} fps, {r['clips']} clips of {WINDOW_S:g} s: "
              f"peak RSS of the process tree {r['peak_rss_gib']:.2f} GiB (target < 1.5; CPU-stage process "
              f"{r['self_rss_gib']:.2f} + decoder child {r['child_rss_gib']:.2f}; {r['base_rss_gib']:.2f} GiB before "
              f"the first frame: imports, processor, the file's bytes), {r['cpu_s']:.1f} CPU s "
              f"({r['child_cpu_s']:.1f} in the decoder child), {r['wall_s']:.1f} s")
    if "compare" in parts:
        src = make_video(cache / f"cmp_{a.minutes:g}min_720p_{a.fps:g}fps.mp4", a.minutes * 60, a.fps, 1280, 720)
        methods = a.methods.split(",") + (["files"] if a.clip_files else [])
        if a.clip_files and "fixed" not in methods:
            methods.insert(0, "fixed")  # the extra CPU is measured against it
        res = {m: measure(m, src) for m in methods}
        for m, name in (("fixed", "vlbatch one decode"), ("scenes", "vlbatch scenes"), ("cut", "cut-then-caption"),
                        ("files", "vlbatch + clip files")):
            if m not in res:
                continue
            r = res[m]
            print(f"compare: {name:20s} {r['clips']:4d} clips {r['patches']:8d} patches  {r['cpu_s']:7.1f} CPU s "
                  f"{r['wall_s']:7.1f} s  peak RSS {r['peak_rss_gib']:.2f} GiB")
        what = f"compare: {a.minutes:g} min 1280x720 at {a.fps:g} fps, {WINDOW_S:g} s windows:"
        if "cut" in res and "fixed" in res:
            print(f"{what} cut-then-caption / vlbatch CPU {res['cut']['cpu_s'] / res['fixed']['cpu_s']:.2f}x "
                  f"(target >= 2), wall {res['cut']['wall_s'] / res['fixed']['wall_s']:.2f}x")
        if "scenes" in res:
            print(f"{what} detection's share of the scenes CPU stage "
                  f"{res['scenes']['detect_s'] / res['scenes']['cpu_s']:.1%} (target <= 15 %)")
        if "files" in res:
            f = res["files"]
            print(f"{what} clip files (mp4, libx264 crf 23 veryfast, {f['file_mb']:.1f} MiB, encoded in the decoder "
                  f"child): +{f['cpu_s'] - res['fixed']['cpu_s']:.1f} CPU s over the one decode "
                  f"({f['cpu_s'] / res['fixed']['cpu_s']:.2f}x), {f['write_s']:.1f} CPU s inside the child's writer, "
                  f"wall +{f['wall_s'] - res['fixed']['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
