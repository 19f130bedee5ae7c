"""`MediaItem` (one image or video of a prompt), its content hash, placeholder runs, and the
split of a processor output's packed pixel values into per-prompt `MediaItem`s.

A media asked several questions is one pixel tensor shared by the items of all its
requests (the pipeline builds them so: no copy, no re-hash per question); the engine keys
vision features and prefix-cache media ids by `content_hash`, so sharing changes nothing
there.

The processor concatenates every image's patches (and separately every video's) over
the whole batch in prompt order; `mm_token_type_ids` marks placeholders (1 image, 2
video). An image fills one run of t*h*w/merge**2 placeholders; a video fills t runs
(one per temporal group, timestamps in between), consumed in order until its count.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from vlbatch.operators.errors import InputError
from vlbatch.operators.model.pixels import normalize_frames, normalize_patches
from vlbatch.operators.preprocess.shipped import media_hash

__all__ = ["MEDIA_KINDS", "MediaItem", "as_tensor", "media_hash", "placeholder_runs", "split_media"]

MEDIA_KINDS = ("image", "video")


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One image or video of a prompt.

    pixel_values: [N_patch, C * T_p * P * P] as the processor packs them: float32 values, or
                  uint8 levels with `table`; or, with `layout`, the resized uint8 frames
                  [F, H, W, C] that `model_input` patchifies on the device (the pipeline's form).
    grid_thw:     (t, h, w) in patches; the item fills t * h * w / merge**2 placeholders.
    spans:        placeholder runs [start, end) in the prompt, in order (a video has one
                  run per temporal group, separated by timestamp text).
    content_hash: `media_hash(...)`; equal hashes mean interchangeable features.
    table:        float32 [C, 256] (`Processor.norm_table`) when pixel_values are uint8
                  levels; they are normalised on the model's device (`model_input`).
    layout:       (patch, merge, temporal) when pixel_values are frames (`frames_to_patches`).
    """

    kind: str
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    spans: tuple[tuple[int, int], ...]
    content_hash: str = ""
    table: torch.Tensor | None = None
    layout: tuple[int, int, int] | None = None

    def __post_init__(self):
        if self.kind not in MEDIA_KINDS:
            raise InputError(f"media kind must be one of {MEDIA_KINDS}, got {self.kind!r}")
        if self.layout is not None:
            self._check_frames()
        elif self.pixel_values.shape[0] != math.prod(self.grid_thw):
            raise InputError(f"{self.kind} pixel_values has {self.pixel_values.shape[0]} patches, grid "
                             f"{self.grid_thw} needs {math.prod(self.grid_thw)}")
        if (self.pixel_values.dtype == torch.uint8) != (self.table is not None):
            raise InputError(f"{self.kind} pixel_values are {self.pixel_values.dtype}: uint8 levels need a "
                             "normalisation table, float values none")
        if not self.content_hash:
            object.__setattr__(self, "content_hash",
                               media_hash(self.kind, self.pixel_values, self.grid_thw, self.table, self.layout))

    def _check_frames(self) -> None:
        """Frames `[F, H, W, C]` must fill the grid exactly: t = ceil(F / temporal), H = h * patch, W = w * patch."""
        (t, h, w), (patch, merge, temporal) = self.grid_thw, self.layout
        shape = tuple(self.pixel_values.shape)
        if (self.pixel_values.dim() != 4 or self.pixel_values.dtype != torch.uint8 or h % merge or w % merge
                or shape[1:3] != (h * patch, w * patch) or -(-shape[0] // temporal) != t):
            raise InputError(f"{self.kind} frames {shape} {self.pixel_values.dtype} do not fill grid "
                             f"{self.grid_thw} with (patch, merge, temporal) {self.layout}")

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)

    def positions(self) -> np.ndarray:
        """[num_tokens] prompt positions of the placeholders, feature row order."""
        return np.concatenate([np.arange(s, e) for s, e in self.spans]) if self.spans else np.zeros(0, np.int64)

    def model_input(self, device, dtype: torch.dtype) -> torch.Tensor:
        """[N_patch, D] on `device`: float pixel values as they are (the tower casts), uint8
        levels moved as uint8 (4x fewer bytes) then normalised there in `dtype`."""
        if self.table is None:
            return self.pixel_values.to(device)
        table = self.table.to(device=device, dtype=dtype)
        if self.layout is not None:
            patch, merge, temporal = self.layout
            return normalize_frames(self.pixel_values.to(device), table, patch=patch, merge=merge, temporal=temporal)
        return normalize_patches(self.pixel_values.to(device), table)


def placeholder_runs(types) -> tuple[tuple[int, int], ...]:
    """[start, end) runs of the non-zero entries of a 1-D `mm_token_type_ids` row (numpy or torch)."""
    return tuple((s, e) for _, s, e in _runs(as_tensor(types)))


def as_tensor(x) -> torch.Tensor:
    """A processor output value (numpy or torch) as a tensor (no copy when it already is one)."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


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
    grids = {1: as_tensor(out["image_grid_thw"]) if out.get("image_grid_thw") is not None else None,
             2: as_tensor(out["video_grid_thw"]) if out.get("video_grid_thw") is not None else None}
    pixels = {1: out.get("pixel_values"), 2: out.get("pixel_values_videos")}
    # items of earlier prompts in the batch come first in the packed tensors: skip them
    counters = {1: 0, 2: 0}
    offsets = {1: 0, 2: 0}
    for b in range(index):
        row = types[b][as_tensor(out["attention_mask"])[b].bool()] if "attention_mask" in out else types[b]
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
            pv = as_tensor(pixels[kind_])[offsets[kind_]: offsets[kind_] + t * h * w]
            items.append(MediaItem("image" if kind_ == 1 else "video", pv, (t, h, w), tuple(spans)))
            offsets[kind_] += t * h * w
            counters[kind_] += 1
            pending = None
    if pending is not None:
        raise InputError(f"{pending[2]} placeholders missing for a grid {pending[1]}")
    return tuple(items)
