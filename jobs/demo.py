"""`vlbatch demo`: the README's demo job, end to end, and a preprocessing-only report.

`run_demo(out_dir)` is `make demo`: `vlbatch.pipeline.demo.prepare_demo` writes synthetic scene
media (images and videos the bundled model `models/shapes-tiny` was trained to describe),
deliberately bad files and a manifest under `out_dir`, then `configs/demo.yaml` runs
through the real pipeline on a local Ray (decode, preprocess, engine, Parquet writer).
Every media (or clip: the reel is cut into scenes) is printed: its caption and structured answer
next to the scene generator's record, or the error type of a bad file; the structured question's
match rate and the reel's cuts found vs the true ones (`jobs/demo_report.py`); then the next
step (`vlbatch inspect` on the run, with `--html`) and the run's closing line, last. A second run
resumes: committed rows are not recomputed.

`run_preprocess_demo(out_dir)` (`vlbatch demo --preprocess-only`) runs only
`vlbatch.operators.preprocess.Processor` over a few generated images in several modes and
sizes plus one synthetic clip and prints grid_thw, patches, visual tokens and prompt
tokens per item. It finishes in seconds.
"""
from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import numpy as np

CAPTION = "Describe this {kind} in one sentence."


def _gradient(h: int, w: int, seed: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 128 + 100 * np.sin((x + y) / 9)], -1)
    noise = np.random.default_rng(seed).integers(-6, 7, rgb.shape)
    return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def sample_images() -> list[tuple[str, bytes]]:
    """(name, encoded bytes) in several modes, formats and sizes."""
    from PIL import Image

    def enc(img, fmt, **kw):
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kw)
        return buf.getvalue()

    rgb = Image.fromarray(_gradient(480, 640, 0))
    rgba = Image.fromarray(np.dstack([_gradient(300, 300, 1), np.linspace(0, 255, 300 * 300).reshape(300, 300)
                                      .astype(np.uint8)]), "RGBA")
    return [
        ("rgb_640x480.jpg", enc(rgb, "JPEG", quality=90)),
        ("rgb_1920x1080.jpg", enc(Image.fromarray(_gradient(1080, 1920, 2)), "JPEG", quality=85)),
        ("rgba_300x300.png", enc(rgba, "PNG")),
        ("palette_200x120.gif", enc(Image.fromarray(_gradient(120, 200, 3)).convert("P"), "GIF")),
        ("gray_17x23.png", enc(Image.fromarray(_gradient(23, 17, 4)[..., 0]), "PNG")),
        ("cmyk_400x100.jpg", enc(Image.fromarray(_gradient(100, 400, 5)).convert("CMYK"), "JPEG")),
        ("panorama_1000x8.png", enc(Image.fromarray(_gradient(8, 1000, 6)), "PNG")),
    ]


def sample_clip():
    """A synthetic 10 s, 25 fps clip sampled at 2 fps (a moving square over a gradient)."""
    from vlbatch.operators.preprocess import sample_frame_indices
    from vlbatch.operators.types import VideoClip

    total, fps = 250, 25.0
    idx = sample_frame_indices(total, fps, fps=2.0)
    base = _gradient(360, 640, 7)
    frames = np.repeat(base[None], len(idx), axis=0)
    for k, i in enumerate(idx):
        x = int(i) * 2 % 560
        frames[k, 140:220, x:x + 80] = (255, 40, 40)
    return VideoClip(frames=frames, source_fps=fps, total_frames=total, indices=tuple(int(i) for i in idx))


def _checkpoint(out: Path) -> Path:
    from vlbatch.devtools.checkpoints.tiny import make_tiny_checkpoint

    ckpt = out / "tiny-checkpoint"
    if not (ckpt / "config.json").exists():
        make_tiny_checkpoint(ckpt, "dense")
    return ckpt


def run_preprocess_demo(out_dir: str | Path = "out/demo") -> int:
    """Preprocessing only: one line per sample item (see the module docstring)."""
    from vlbatch.operators.errors import VlbatchError
    from vlbatch.operators.preprocess import Processor, load_image

    start = time.perf_counter()
    out = Path(out_dir)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    proc = Processor.from_pretrained(_checkpoint(out))
    merge2 = proc.spatial_merge_size ** 2
    print(f"checkpoint: {out / 'tiny-checkpoint'}")
    print(f"{'item':<24} {'input':<18} {'grid_thw':<14} {'patches':>8} {'visual':>7} {'prompt':>7}")
    items = [(name, "image", data) for name, data in sample_images()]
    items.append(("clip_640x360_25fps.npy", "video", sample_clip()))
    failures = 0
    for name, kind, data in items:
        msgs = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": CAPTION.format(kind=kind)}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
        try:
            if kind == "image":
                (out / "samples" / name).write_bytes(data)
                pixels = load_image(data)
                desc = f"{pixels.shape[1]}x{pixels.shape[0]}"
                res = proc(text, images=[pixels])
                grid, patches = res["image_grid_thw"][0], res["pixel_values"].shape[0]
            else:
                desc = f"{len(data.indices)}f {data.frames.shape[2]}x{data.frames.shape[1]}"
                res = proc(text, videos=[data])
                grid, patches = res["video_grid_thw"][0], res["pixel_values_videos"].shape[0]
        except VlbatchError as e:
            failures += 1
            print(f"{name:<24} error {e.error_type}: {e}")
            continue
        visual = int(grid.prod()) // merge2
        print(f"{name:<24} {desc:<18} {str(grid.tolist()):<14} {patches:>8} {visual:>7} {res['input_ids'].shape[1]:>7}")
    try:
        load_image(b"not an image")
    except VlbatchError as e:
        print(f"{'bad_bytes.bin':<24} error row -> {e.error_type}: {e}")
    print(f"done in {time.perf_counter() - start:.1f}s; samples written to {out / 'samples'}")
    return 1 if failures else 0


DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def run_demo(out_dir: str | Path = "out/demo", *, show: int = 40) -> int:
    """The demo job through the whole pipeline on a local Ray; prints `show` output rows, then the run's
    closing line and the next step (`vlbatch inspect` on the run)."""
    from vlbatch.jobs.demo_report import print_report
    from vlbatch.jobs.local import run_local, summary_line
    from vlbatch.pipeline.demo import demo_overrides, demo_truth, prepare_demo

    out = Path(out_dir)
    prepare_demo(out)
    held: list = []
    rc = run_local(DEMO_CONFIG, demo_overrides(out), name="demo", use_lock=False, report=held.append)
    print_report(out / "output", show, demo_truth(out), sys.stdout)
    for summary in held:  # the closing line last, the next step just before it
        run_dir = summary.output_dir.rstrip("/")
        print(f"[vlbatch] next: vlbatch inspect {_shown(run_dir)} --html {_shown(str(out / 'report.html'))}")
        print(summary_line(summary), flush=True)
    return rc


def _shown(path: str) -> str:
    """`path` relative to the current directory when it is below it (as a user would type it)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path
