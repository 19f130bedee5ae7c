"""Split a processor output's packed pixel values into per-prompt `MediaItem`s.

The processor concatenates every image's patches (and separately every video's) over
the whole batch in prompt order; `mm_token_type_ids` marks placeholders (1 image, 2
video). An image fills one run of t*h*w/merge**2 placeholders; a video fills t runs
(one per temporal group, timestamps in between), consumed in order until its count.
"""
from __future__ import annotations

import itertools

import torch

from vlbatch.operators.errors import InputError


def _runs(types: torch.Tensor) -> list[tuple[int, int, int]]:
    """(modality, start, end) runs of a 1-D type row, text runs dropped."""
    out, pos = [], 0
    for key, grp in itertools.groupby(types.tolist()):
        n = len(list(grp))
        if key != 0:
            out.append((int(key), pos, pos + n))
        pos += n
    return out


def split_media(ids, types, out: dict, index: int, keep: torch.Tensor, merge: int):
    """MediaItems of prompt `index` (positions after removing padding)."""
    from vlbatch.operators.engine.request import MediaItem, _t

    grids = {1: _t(out["image_grid_thw"]) if out.get("image_grid_thw") is not None else None,
             2: _t(out["video_grid_thw"]) if out.get("video_grid_thw") is not None else None}
    pixels = {1: out.get("pixel_values"), 2: out.get("pixel_values_videos")}
    # items of earlier prompts in the batch come first in the packed tensors: skip them
    counters = {1: 0, 2: 0}
    offsets = {1: 0, 2: 0}
    for b in range(index):
        row = types[b][_t(out["attention_mask"])[b].bool()] if "attention_mask" in out else types[b]
        for kind in (1, 2):
            need = int((row == kind).sum())
            while need > 0:
                t, h, w = (int(v) for v in grids[kind][counters[kind]])
                need -= t * h * w // merge**2
                offsets[kind] += t * h * w
                counters[kind] += 1
    row = types[index][keep]
    items, pending = [], None
    for kind, s, e in _runs(row):
        if pending is None:
            if grids[kind] is None or counters[kind] >= len(grids[kind]):
                raise InputError("placeholders without a matching grid in the processor output")
            t, h, w = (int(v) for v in grids[kind][counters[kind]])
            pending = [kind, (t, h, w), t * h * w // merge**2, []]
        pending[3].append((s, e))
        pending[2] -= e - s
        if pending[2] < 0:
            raise InputError(f"placeholder run longer than its grid {pending[1]}")
        if pending[2] == 0:
            kind_, (t, h, w), _, spans = pending
            pv = _t(pixels[kind_])[offsets[kind_]: offsets[kind_] + t * h * w]
            items.append(MediaItem("image" if kind_ == 1 else "video", pv, (t, h, w), tuple(spans)))
            offsets[kind_] += t * h * w
            counters[kind_] += 1
            pending = None
    if pending is not None:
        raise InputError(f"{pending[2]} placeholders missing for a grid {pending[1]}")
    return tuple(items)
