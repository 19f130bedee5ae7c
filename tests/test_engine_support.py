"""Shared helpers for the engine tests (no tests here).

Requests are built the reference way: transformers' processor (chat template, image /
video processors) on the tiny checkpoint, and MRoPE positions from transformers'
`get_rope_index`, so the engine is fed exactly what the reference model sees.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from vlbatch.operators.engine import Request, SamplingParams

# the prefix caches (`EngineConfig.prefix_cache`): the prefix tests run against both, the radix tree
# and its naive twin (a dict of exact prefixes)
PREFIX_CACHES = ("radix", "dict")


@functools.lru_cache(maxsize=4)
def processor(ckpt: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ckpt)


@functools.lru_cache(maxsize=4)
def reference_model(ckpt: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()


def image(seed: int, h: int = 40, w: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def video(seed: int, frames: int = 4, h: int = 48, w: int = 64) -> np.ndarray:
    return np.random.default_rng(1000 + seed).integers(0, 256, (frames, h, w, 3), dtype=np.uint8)


def processed(ckpt, content: list, *, system: str | None = None, thinking: bool = False) -> dict:
    """Processor output (torch) + position_ids [3, 1, L] / rope_deltas of one chat prompt.

    content: items "text" strings, ("image", array) or ("video", array) in order.
    """
    proc = processor(str(ckpt))
    parts, images, videos = [], [], []
    for c in content:
        if isinstance(c, str):
            parts.append({"type": "text", "text": c})
        elif c[0] == "image":
            parts.append({"type": "image"})
            images.append(c[1])
        else:
            parts.append({"type": "video"})
            videos.append(c[1])
    msgs = ([{"role": "system", "content": [{"type": "text", "text": system}]}] if system else [])
    msgs.append({"role": "user", "content": parts})
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=thinking)
    kw = {}
    if videos:
        kw = {"do_sample_frames": False,
              "video_metadata": [{"fps": 2.0, "total_num_frames": len(v), "frames_indices": list(range(len(v)))}
                                 for v in videos]}
    out = dict(proc(text=[text], images=images or None, videos=videos or None, return_tensors="pt", **kw))
    ref = reference_model(str(ckpt))
    pos, delta = ref.model.get_rope_index(out["input_ids"], out["mm_token_type_ids"], out.get("image_grid_thw"),
                                          out.get("video_grid_thw"), out["attention_mask"])
    out["position_ids"], out["rope_deltas"] = pos, delta
    return out


def request(ckpt, rid: str, content: list, *, max_new_tokens: int = 8, system: str | None = None,
            thinking: bool = False, **sampling) -> Request:
    out = processed(ckpt, content, system=system, thinking=thinking)
    return Request.from_processor(rid, out, sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling),
                                  thinking=thinking)


def reference_greedy(ckpt, content: list, max_new_tokens: int, **kw) -> list[int]:
    """transformers' generate (greedy) on the same prompt: the generated ids, eos included."""
    out = processed(ckpt, content, **kw)
    ref = reference_model(str(ckpt))
    inputs = {k: v for k, v in out.items() if k not in ("position_ids", "rope_deltas")}
    with torch.no_grad():
        seq = ref.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return seq[0, out["input_ids"].shape[1]:].tolist()


def assert_static_used(stats: dict, engine_kw: dict) -> None:
    """With static decode on (`engine_kw`, the conftest fixture), some decode steps took the
    static path; with it off, none."""
    steps = stats["static_decode_steps"]
    assert (steps > 0) == bool(engine_kw.get("static_decode")), steps
