"""Video clips benchmark (issue 51): bounded memory of a long video, and one decode vs cut-then-caption.

    python -m benchmarks.bench_clips [--cache DIR] [--long-hours 2 --long-fps 2] [--minutes 10 --fps 30]
        [--parts rss,compare] [--clip-files]

Videos (generated once into the cache dir, H.264 ultrafast, a hard cut every 7 s, a moving square): a
`--long-hours` 854x480 video at `--long-fps` of solid scenes (low rate and plain, to keep it small on
disk) and a `--minutes` 1280x720 video at `--fps` of panning random textures (real work for the codec).

rss: the long video through the CPU stage's clip work in 10 s windows (`decode_clips`, fixed windows,
    every clip preprocessed by our `Processor` of the bundled shapes-tiny checkpoint), in a child
    process; its peak RSS printed (target < 1.5 GiB).
compare: the 720p video in 10 s windows, each path in its own child process (CPU s = user + system of
    that process, wall s):
    - vlbatch: one decode (`decode_clips`, fixed), each clip sampled at 2 fps and preprocessed;
    - scenes:  the same with `mode: scenes` (the content detector on every frame); detection's share
      of its CPU stage (the CPU in scaling pictures for the detector and in its score, timed around
      `clip_decode._State._detect`, over the child's CPU) printed (target <= 15 %);
    - cut-then-caption: what users do today: cut the file into 10 s clip files with PyAV (decode and
      re-encode, libx264 veryfast), then each clip file as a whole-video media (`clips.mode: none`:
      `decode_video_inprocess` at 2 fps + the same preprocess).
    - with `--clip-files`: vlbatch one decode again, also writing every clip as a file (`output.clip_files`
      defaults: mp4, libx264 crf 23 veryfast, `operators/media/clip_files.py`, to a temp folder); the extra
      CPU seconds over the plain one-decode run printed, and the CPU inside the writer's hook.
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


def _clip_file_hook(folder: str, spent: list[float]):
    """`decode_clips`' hook writing each clip file under `folder` (its CPU added to `spent[0]`)."""
    from vlbatch.operators.media.clip_files import ClipFileSettings, ClipTarget, write_clip
    from vlbatch.operators.storage import StorageOptions

    target = ClipTarget(folder=folder, settings=ClipFileSettings(), storage=StorageOptions())

    def hook(clip, frames, stream, rotation: int = 0) -> None:
        c0 = time.process_time()
        write_clip(target, f"clip-{clip.index:05d}", frames, stream, rotation)
        spent[0] += time.process_time() - c0

    return hook


def run_vlbatch(path: str, mode: str) -> dict:
    """One decode: every clip of the video, sampled and preprocessed (child process); mode `files`:
    fixed windows, each clip also written as a clip file."""
    import tempfile

    from vlbatch.operators.media import clip_decode
    from vlbatch.operators.media.clip_decode import decode_clips
    from vlbatch.operators.media.clips import ClipRule
    from vlbatch.operators.media.video import FrameSampling

    detect_s = [0.0]
    inner = clip_decode._State._detect

    def timed(self, i, frame):  # the detector's CPU: scaling the picture + PySceneDetect's score
        c0 = time.process_time()
        try:
            return inner(self, i, frame)
        finally:
            detect_s[0] += time.process_time() - c0

    clip_decode._State._detect = timed
    proc = _processor()
    data = Path(path).read_bytes()
    base = _rss_gib()  # imports, the processor and the video's bytes, before any frame
    clips = tokens = 0
    write_s = [0.0]
    with tempfile.TemporaryDirectory() as folder:
        hook = _clip_file_hook(folder, write_s) if mode == "files" else None
        rule = ClipRule(mode="fixed" if mode == "files" else mode, window_s=WINDOW_S)
        for _clip, vc in decode_clips(data, rule, FrameSampling(fps=2.0), on_clip=hook):
            media = proc.encode_media(videos=[vc], frames=True)
            tokens += int(media.arrays["video_grid_thw"][0].prod())
            clips += 1
        file_mb = sum(f.stat().st_size for f in Path(folder).iterdir()) / 2**20
    return {"clips": clips, "patches": tokens, "detect_s": detect_s[0], "base_rss_gib": base,
            "write_s": write_s[0], "file_mb": file_mb}


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
    t0, c0 = time.perf_counter(), time.process_time()
    out = run_cut_then_caption(path) if method == "cut" else run_vlbatch(path, method)
    out.update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0,
               peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
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
                    help="compare: also the one-decode path writing clip files (output.clip_files); prints the "
                         "extra CPU seconds")
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "PATH"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(*a.child)
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    if "rss" in parts:
        long = make_video(cache / f"long_{a.long_hours:g}h_480p_{a.long_fps:g}fps.mp4", a.long_hours * 3600,
                          a.long_fps, 854, 480, plain=True)
        r = measure("fixed", long)
        print(f"rss: {a.long_hours:g} h 854x480 at {a.long_fps:g} fps, {r['clips']} clips of {WINDOW_S:g} s: "
              f"peak RSS {r['peak_rss_gib']:.2f} GiB (target < 1.5; {r['base_rss_gib']:.2f} GiB before the first "
              f"frame: imports, processor, the file's bytes), {r['cpu_s']:.1f} CPU s, {r['wall_s']:.1f} s")
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
        if "files" in res:
            f = res["files"]
            print(f"{what} clip files (mp4, libx264 crf 23 veryfast, {f['file_mb']:.1f} MiB): "
                  f"+{f['cpu_s'] - res['fixed']['cpu_s']:.1f} CPU s over the one decode "
                  f"({f['cpu_s'] / res['fixed']['cpu_s']:.2f}x), {f['write_s']:.1f} CPU s inside the writer, "
                  f"wall +{f['wall_s'] - res['fixed']['wall_s']:.1f} s")
        if "scenes" in res:
            print(f"{what} detection's share of the scenes CPU stage "
                  f"{res['scenes']['detect_s'] / res['scenes']['cpu_s']:.1%} (target <= 15 %)")


if __name__ == "__main__":
    main()
