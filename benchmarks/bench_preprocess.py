"""Preprocessing throughput: our Processor vs transformers' AutoProcessor, side by side.

    python3 -m benchmarks.bench_preprocess [--threads 2] [--iters 12] [--model-dir DIR]

Both processors run in this process on the same inputs (numpy RGB arrays /
sampled clips, the same prompt) and the same tiny checkpoint's configs (the 9B
preprocessing values). Each case first checks that the two outputs are identical
(ids, grids, position ids, max |pixel diff|), then times one request per call
(prompt + one image or one clip), alternating ours / reference, and prints
items/s for each (median wall time per call), the wall-time ratio, and the ratio
of median process CPU time per call (robust when other work shares the cores).
Threads default to 2, the target machine's core count.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _inputs(rng):
    def image(h, w):
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)

    def clip(frames, h, w, fps=30.0):
        from vlbatch.operators.preprocess import sample_frame_indices
        from vlbatch.operators.types import VideoClip

        total = int(frames * fps / 2)  # 2 fps sampling of a clip of that length
        idx = sample_frame_indices(total, fps, fps=2.0)
        return VideoClip(rng.integers(0, 256, (len(idx), h, w, 3), dtype=np.uint8), fps, total,
                         tuple(int(i) for i in idx))

    return [
        ("image 640x480", "image", image(480, 640)),
        ("image 1920x1080", "image", image(1080, 1920)),
        ("video 16f 640x360", "video", clip(16, 360, 640)),
        ("video 8f 1280x720", "video", clip(8, 720, 1280)),
    ]


def _check(ref_out, ours) -> str:
    from vlbatch.operators.preprocess.rope import mrope_position_ids

    same = all(np.array_equal(ours[k], ref_out[k]) for k in ref_out if not k.startswith("pixel_values"))
    diff = max(float(np.abs(ours[k] - ref_out[k]).max()) for k in ref_out if k.startswith("pixel_values"))
    pos, _ = mrope_position_ids(ref_out["mm_token_type_ids"], ref_out.get("image_grid_thw"),
                                ref_out.get("video_grid_thw"), ref_out["attention_mask"])
    same = same and np.array_equal(pos, ours["position_ids"])
    return f"identical ids/grids: {same}, max |pixel diff|: {diff:g}"


def _runners(ours, ref, kind: str, text: str, item):
    """(ours, reference) zero-argument callables processing one request."""
    if kind == "image":
        return (lambda: ours(text, images=[item]),
                lambda: ref(text=[text], images=[item], return_tensors="np"))
    meta = [{"total_num_frames": item.total_frames, "fps": item.source_fps, "frames_indices": list(item.indices)}]
    return (lambda: ours(text, videos=[item]),
            lambda: ref(text=[text], videos=[item.frames], video_metadata=meta, do_sample_frames=False,
                        cap_pixels_per_frame=False, return_tensors="np"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--model-dir", default=None, help="checkpoint folder (default: a fresh tiny checkpoint)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoProcessor
    from transformers.utils import logging

    from vlbatch.devtools.checkpoints.tiny import write_tokenizer_and_processor
    from vlbatch.operators.preprocess import Processor

    torch.set_num_threads(args.threads)
    logging.set_verbosity_error()
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        write_tokenizer_and_processor(Path(tmp.name))  # processor files only; no weights needed
        model_dir = tmp.name
    else:
        model_dir = args.model_dir
    ref, ours = AutoProcessor.from_pretrained(model_dir), Processor.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    print(f"torch threads: {args.threads}; iterations per case: {args.iters}")
    print(f"{'case':<20} {'ours/s':>9} {'reference/s':>12} {'ratio':>7} {'cpu ratio':>10}   check")
    for name, kind, item in _inputs(rng):
        msgs = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Describe this."}]}]
        text = ours.apply_chat_template(msgs)
        run_ours, run_ref = _runners(ours, ref, kind, text, item)
        check = _check(run_ref(), run_ours())
        wall = {"ours": [], "ref": []}
        cpu = {"ours": [], "ref": []}
        for _ in range(args.iters):
            for who, fn in (("ours", run_ours), ("ref", run_ref)):
                w0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[who].append(time.perf_counter() - w0)
                cpu[who].append(time.process_time() - c0)
        a, b = statistics.median(wall["ours"]), statistics.median(wall["ref"])
        ca, cb = statistics.median(cpu["ours"]), statistics.median(cpu["ref"])
        print(f"{name:<20} {1 / a:>9.1f} {1 / b:>12.1f} {b / a:>6.2f}x {cb / ca:>9.2f}x   {check}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
