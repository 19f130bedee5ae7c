"""Pixel path between the CPU stage and the model: float32 patches (before) vs uint8 frames (now), side by side.

    python -m benchmarks.bench_pixel_path [--iters 5] [--threads 2] [--questions 8] [--model-dir DIR]

One run, three tables (the tiny checkpoint's processor files: the 9B preprocessing values):
1. bytes per media between the CPU and model stages: the Arrow size of the CPU stage's row
   for one question, with the float32 patches (+ the `mm_token_type_ids` column the old row
   carried) vs the resized uint8 frames it ships now (the uint8 patch layout, the step
   between, for reference), for an image 640x480, an image 1920x1080 and a 16-frame
   1280x720 clip; the check column says the frames made into normalised patches on the
   model side (`normalize_frames`) equal the float32 values bit for bit;
2. CPU stage cost per media (median process CPU time per call): our float32 processor and
   transformers' AutoProcessor on the rendered prompt, against the CPU stage's whole
   `prepare_one` now (chat template, resize, tokens, MRoPE, the content hash, the row);
   CPU-time ratios against AutoProcessor;
3. the model actor with one 1920x1080 image asked `--questions` questions: a fresh process
   per path reads the row's Arrow bytes (as the object store hands them over) and builds the
   engine requests (the model is not run): before, one writable float32 copy and one hash
   per question (`Request.from_processor` on the old processor dict); now, one tensor over
   the Arrow buffer shared by all requests. Peak RSS over the process's baseline, pixel
   bytes held (distinct buffers) against one copy of the shipped patches, CPU seconds.
Targets: 4x fewer bytes; CPU stage time per 640x480 image >= 8x below AutoProcessor's; pixel
memory within 1.2x of one copy. On a shared machine the timings are noisy (the ratios less so).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _cases(rng):
    from vlbatch.pipeline.stages.rows import Decoded

    def clip(frames, h, w, fps=30.0):
        idx = tuple(range(0, frames * 15, 15))  # 2 fps sampling of a 30 fps clip
        return Decoded("clip.mp4", "video", ("q0",), (0,), ("What happens?",),
                       frames=rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8), source_fps=fps,
                       total_frames=frames * 15, frame_indices=idx)

    def image(h, w):
        return Decoded(f"img{w}x{h}.jpg", "image", ("q0",), (0,), ("Describe.",),
                       frames=rng.integers(0, 256, (1, h, w, 3), dtype=np.uint8))

    return [("image 640x480", image(480, 640)), ("image 1920x1080", image(1080, 1920)),
            ("video 16f 1280x720", clip(16, 720, 1280))]


def _stage(model_dir: str):
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.stages.preprocess import PreprocessStage

    return PreprocessStage(validate_config({"model": {"path": model_dir}, "input": {"uri": "x"},
                                            "output": {"uri": tempfile.gettempdir()}}))


def _float32_row(stage, row, prep):
    """The row as the CPU stage wrote it before: float32 patches, plus its mm_token_type_ids."""
    media = stage.media_kwargs(row)
    pv = stage.processor.encode_media(**media).arrays["pixel_values" if row.media_type == "image"
                                                      else "pixel_values_videos"]
    types = []
    for i, ids in enumerate(prep.input_ids):
        t = [0] * len(ids)
        for s, e in prep.prompt_spans(i):
            t[s:e] = [1 if row.media_type == "image" else 2] * (e - s)
        types.append(t)
    return replace(prep, pixels=pv), types


def _bytes_table(stage, cases) -> None:
    import pyarrow as pa
    import torch

    from vlbatch.operators.model.pixels import normalize_frames
    from vlbatch.pipeline.stages.rows import Prepared, to_table

    print(f"\n1. bytes per media, CPU stage -> model stage\n{'case':<20} {'float32 (before)':>17} "
          f"{'uint8 patches':>14} {'uint8 frames (now)':>19} {'ratio':>7}   frames             check")
    for name, row in cases:
        prep = stage.prepare_one(row)
        old, types = _float32_row(stage, row, prep)
        before = to_table([old], Prepared).nbytes + pa.array(types, pa.list_(pa.int64())).nbytes
        levels = stage.processor.encode_media(**stage.media_kwargs(row), uint8=True).arrays[
            "pixel_values" if row.media_type == "image" else "pixel_values_videos"]
        mid = to_table([replace(prep, pixels=levels)], Prepared).nbytes
        now = to_table([prep], Prepared).nbytes
        cfg = stage.processor.image_config if row.media_type == "image" else stage.processor.video_config
        patch, merge, temporal = cfg.layout
        table = torch.from_numpy(stage.processor.norm_table(row.media_type))
        made = normalize_frames(torch.from_numpy(prep.pixels), table, patch=patch, merge=merge, temporal=temporal)
        same = np.array_equal(made.numpy().view(np.uint32), old.pixels.view(np.uint32))
        print(f"{name:<20} {before / 1e6:>14.1f} MB {mid / 1e6:>11.1f} MB {now / 1e6:>16.1f} MB "
              f"{before / now:>6.2f}x   {str(prep.pixels.shape):<18} "
              f"normalised on the model side == float32 bit for bit: {same}")


def _median_cpu(fn, iters: int) -> float:
    fn()  # warm-up (numba compile, caches)
    out = []
    for _ in range(iters):
        c0 = time.process_time()
        fn()
        out.append(time.process_time() - c0)
    return statistics.median(out)


def _runners(stage, ref, row):
    """(our float32 processor, the CPU stage now, AutoProcessor) zero-argument callables for one media."""
    from vlbatch.pipeline.stages.preprocess import chat_messages

    proc, kind = stage.processor, row.media_type
    text = proc.apply_chat_template(chat_messages(row.prompts[0], kind, None))
    media = stage.media_kwargs(row)

    if kind == "image":
        def run_ref():
            return ref(text=[text], images=list(media["images"]), return_tensors="np")
    else:
        c = media["videos"][0]
        meta = [{"total_num_frames": c.total_frames, "fps": c.source_fps, "frames_indices": list(c.indices)}]

        def run_ref():
            return ref(text=[text], videos=[c.frames], video_metadata=meta, do_sample_frames=False,
                       cap_pixels_per_frame=False, return_tensors="np")
    return (lambda: proc(text, **media)), (lambda: stage.prepare_one(row)), run_ref


def _cpu_table(stage, ref, cases, iters: int) -> None:
    print(f"\n2. CPU stage per media, median CPU ms per call ({iters} calls)\n{'case':<20} {'float32':>9} "
          f"{'stage now':>10} {'AutoProcessor':>14} {'ref/float32':>12} {'ref/now':>8}")
    for name, row in cases:
        run_f32, run_now, run_ref = _runners(stage, ref, row)
        f32 = _median_cpu(run_f32, iters)
        now = _median_cpu(run_now, iters)
        r = _median_cpu(run_ref, max(2, iters // 2))
        print(f"{name:<20} {f32 * 1e3:>9.2f} {now * 1e3:>10.2f} {r * 1e3:>14.2f} {r / f32:>11.2f}x {r / now:>7.2f}x")


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(path: str, mode: str, model_dir: str) -> dict:
    """One model actor's pixel work for one row (fresh process): read, build the requests."""
    import pyarrow as pa

    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.engine.loop import pinned_visual_tokens
    from vlbatch.pipeline.backends.backends import media_requests, pixel_specs
    from vlbatch.pipeline.stages.rows import Prepared, from_table

    specs = pixel_specs(model_dir)
    base = _rss_kb("VmRSS")
    c0 = time.process_time()
    data = Path(path).read_bytes()  # the object store's copy of the batch
    (row,) = from_table(pa.ipc.open_stream(pa.py_buffer(data)).read_all(), Prepared)
    del data
    if mode == "after":
        reqs = list(media_requests(row, specs[row.media_type], lambda rid: SamplingParams(), False).values())
    else:  # the old model stage: processor_dict (a writable copy) + Request.from_processor (split + sha256)
        reqs = []
        for i, rid in enumerate(row.ids):
            ids = np.asarray(row.input_ids[i], np.int64)[None]
            types = np.zeros_like(ids)
            for s, e in row.prompt_spans(i):
                types[0, s:e] = 1
            out = {"input_ids": ids, "attention_mask": np.ones_like(ids), "mm_token_type_ids": types,
                   "position_ids": np.asarray(row.prompt_positions(i), np.int64)[:, None],
                   "rope_deltas": np.asarray([row.rope_deltas[i]], np.int64),
                   "pixel_values": np.require(row.pixels, requirements=["W"]),
                   "image_grid_thw": np.asarray(row.grid_thw, np.int64)[None]}
            reqs.append(Request.from_processor(rid, out, 0))
    cpu = time.process_time() - c0
    arrow = (row.pixels.ctypes.data, row.pixels.nbytes)
    held = {arrow[0]: arrow[1]}
    for r in reqs:
        pv = r.media[0].frames
        if not arrow[0] <= pv.data_ptr() < arrow[0] + arrow[1]:
            held[pv.untyped_storage().data_ptr()] = pv.untyped_storage().nbytes()
    one = row.pixels.nbytes
    return {"peak_mb": (_rss_kb("VmHWM") - base) / 1024, "held_mb": sum(held.values()) / 1e6,
            "held_copies": sum(held.values()) / one, "one_copy_mb": one / 1e6, "cpu_s": cpu,
            "hashes": len({r.media[0].content_hash for r in reqs}), "requests": len(reqs),
            "pinned_visual_tokens": pinned_visual_tokens(reqs), "row_visual_tokens": row.visual_tokens}


def _memory_table(stage, rng, questions: int, model_dir: str) -> None:
    import pyarrow as pa

    from vlbatch.pipeline.stages.rows import Decoded, Prepared, to_table

    qs = tuple(f"Question {k} about this picture?" for k in range(questions))
    row = Decoded("img1080.jpg", "image", tuple(f"q{k}" for k in range(questions)), tuple(range(questions)), qs,
                  frames=rng.integers(0, 256, (1, 1080, 1920, 3), dtype=np.uint8))
    prep = stage.prepare_one(row)
    old, _ = _float32_row(stage, row, prep)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, r in (("before", old), ("after", prep)):
            table = to_table([r], Prepared)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
            path = Path(tmp) / f"{mode}.arrow"
            path.write_bytes(sink.getvalue().to_pybytes())
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_pixel_path", "--child", mode, str(path),
                                  "--model-dir", model_dir], capture_output=True, text=True, check=True)
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n3. model actor, one 1920x1080 image x {questions} questions (requests built, model not run)")
    print(f"{'path':<8} {'peak RSS +MB':>13} {'pixels held MB':>15} {'x one copy':>11} {'one copy MB':>12} "
          f"{'CPU s':>7} {'hashes':>7} {'pinned vis tok':>15}")
    for mode in ("before", "after"):
        m = res[mode]
        print(f"{mode:<8} {m['peak_mb']:>13.1f} {m['held_mb']:>15.1f} {m['held_copies']:>10.2f}x "
              f"{m['one_copy_mb']:>12.1f} {m['cpu_s']:>7.3f} {m['hashes']:>7} "
              f"{m['pinned_visual_tokens']:>8} (row {m['row_visual_tokens']})")
    b, a = res["before"], res["after"]
    print(f"peak RSS before/after: {b['peak_mb'] / max(a['peak_mb'], 1e-9):.2f}x; pixels held before/after: "
          f"{b['held_mb'] / a['held_mb']:.2f}x (now {a['held_copies']:.2f}x one uint8 copy, "
          f"{a['held_mb'] / b['one_copy_mb']:.2f}x one float32 copy)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--model-dir", default=None, help="checkpoint folder (default: the tiny processor files)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[1], args.child[0], args.model_dir)))
        return 0

    import torch
    from transformers import AutoProcessor
    from transformers.utils import logging

    from vlbatch.devtools.checkpoints.tiny import write_tokenizer_and_processor

    torch.set_num_threads(args.threads)
    logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            write_tokenizer_and_processor(Path(tmp))  # processor files only; no weights needed
            model_dir = tmp
        stage = _stage(model_dir)
        rng = np.random.default_rng(0)
        cases = _cases(rng)
        files = "tiny (9B values)" if args.model_dir is None else model_dir
        print(f"torch threads: {args.threads}; processor files: {files}")
        _bytes_table(stage, cases)
        _cpu_table(stage, AutoProcessor.from_pretrained(model_dir), cases, args.iters)
        _memory_table(stage, rng, args.questions, model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
