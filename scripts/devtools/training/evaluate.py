"""Answer scene items with transformers' `generate` (greedy) and score them: the reference runner.

`python -m vlbatch.devtools.training.evaluate models/shapes-tiny` prints the held-out
scores of a checkpoint. Videos go through real files: each clip is encoded to
H.264 MP4, decoded with PyAV and sampled at 2 fps with the reference's rule, as a
pipeline reading video files would see it. One item per `generate` call, so no
padding enters the comparison with other runners.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from vlbatch.devtools.scenes.heldout import SceneItem, clip_of, heldout_items
from vlbatch.devtools.scenes.score import score_answers
from vlbatch.devtools.scenes.videos import decode_mp4


def load_reference(model_dir):
    """(model fp32 eval, processor) through the normal Hugging Face auto classes."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def decoded_item(item: SceneItem) -> SceneItem:
    """A video item whose frames went through MP4 encode + decode (image items unchanged)."""
    if item.media_type != "video":
        return item
    frames = decode_mp4(item.video_bytes())
    return SceneItem(item.id, item.media_type, item.qa, item.scene, video=clip_of(frames, item.scene.fps))


@dataclass(frozen=True)
class Generated:
    """One greedy answer: text (special tokens stripped), token ids, and whether it ended in `<|im_end|>`."""

    text: str
    token_ids: tuple[int, ...]
    stopped: bool


def generate(model, processor, items, max_new_tokens: int = 48) -> list[Generated]:
    """Greedy generation for `items`, one `generate` call each (no padding)."""
    import torch

    from vlbatch.devtools.training.batches import END, media_kwargs, prompt_text

    end_id = processor.tokenizer.convert_tokens_to_ids(END)
    results = []
    for item in items:
        inputs = processor(text=[prompt_text(processor, item)], return_tensors="pt", **media_kwargs([item]))
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        text = processor.tokenizer.decode(new, skip_special_tokens=True).strip()
        results.append(Generated(text, tuple(new), bool(new) and new[-1] == end_id))
    return results


def generate_answers(model, processor, items, max_new_tokens: int = 48) -> list[str]:
    """Greedy answer texts for `items`."""
    return [g.text for g in generate(model, processor, items, max_new_tokens)]


def breakdown(scores) -> str:
    """"task.attribute correct/total" for every (task, attribute) pair the checks cover."""
    from collections import defaultdict

    tally = defaultdict(lambda: [0, 0])
    for c in scores.checks:
        tally[f"{c.task}.{c.attribute}"][0] += c.correct
        tally[f"{c.task}.{c.attribute}"][1] += 1
    return ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in sorted(tally.items()))


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description="Score a checkpoint on the held-out synthetic scenes.")
    ap.add_argument("model_dir")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--videos", type=int, default=80)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=0, help="print this many wrong answers")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, processor = load_reference(args.model_dir)
    items = [decoded_item(it) for it in heldout_items(args.images, args.videos)]
    start = time.time()
    answers = generate_answers(model, processor, items)
    scores = score_answers(items, answers)
    print(f"{len(items)} items in {time.time() - start:.1f}s: {scores.summary()}")
    print("by task / attribute:", breakdown(scores))
    wrong = {c.item_id for c in scores.checks if not c.correct}
    shown = [(it, a) for it, a in zip(items, answers, strict=True) if it.id in wrong][: args.show]
    for it, a in shown:
        print(f"  {it.id}: {it.qa.question!r} -> {a!r} (truth {it.qa.answer!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
