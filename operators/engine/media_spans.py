"""`MediaItem` (one image or video of a prompt), its content hash, placeholder runs, and the
split of a processor output's packed pixel values into per-prompt `MediaItem`s.

`MediaItem` is the engine's one form of a media (`operators/preprocess/shipped.py` owns it):
uint8 frames, grid, `PixelSpec`, hash; `split_media` converts the reference processor's
float patches into it (exactly). A media asked several questions is one pixel tensor shared
by the items of all its requests (the pipeline builds them so: no copy, no re-hash per question); the engine keys
vision features and prefix-cache media ids by `content_hash`, so sharing changes nothing
there.

The processor concatenates every image's patches (and separately every video's) over
the whole batch in prompt order; `mm_token_type_ids` marks placeholders (1 image, 2
video). An image fills one run of t*h*w/merge**2 placeholders; a video fills t runs
(one per temporal group, timestamps in between), consumed in order until its count.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from vlbatch.operators.errors import InputError
from vlbatch.operators.model.pixels import normalize_frames
from vlbatch.operators.preprocess.shipped import PixelSpec, media_hash, patches_to_frames

__all__ = ["MEDIA_KINDS", "MediaItem", "as_tensor", "media_hash", "placeholder_runs", "split_media"]

MEDIA_KINDS = ("image", "video")


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One image or video of a prompt, in the one shipped form (`operators/preprocess/shipped.py`).

    frames:       uint8 `[F, H, W, C]` torch tensor, the resized frames (F = 1 for an image);
                  `model_input` makes the tower's normalised patches of them on the device.
    grid_thw:     (t, h, w) in patches; the item fills t * h * w / merge**2 placeholders.
    spans:        placeholder runs [start, end) in the prompt, in order (a video has one
                  run per temporal group, separated by timestamp text).
    spec:         `PixelSpec`: the normalisation table float32 `[C, 256]` and the layout
                  (patch, merge, temporal) of `frames_to_patches`.
    content_hash: `media_hash(...)` (the CPU stage's, or computed here); equal hashes mean
                  interchangeable features.
    """

    kind: str
    frames: torch.Tensor
    grid_thw: tuple[int, int, int]
    spans: tuple[tuple[int, int], ...]
    spec: PixelSpec
    content_hash: str = ""

    def __post_init__(self):
        if self.kind not in MEDIA_KINDS:
            raise InputError(f"media kind must be one of {MEDIA_KINDS}, got {self.kind!r}")
        self._check_frames()
        if not self.content_hash:
            object.__setattr__(self, "content_hash", media_hash(self.kind, self.frames, self.grid_thw,
                                                                self.spec.table, self.spec.layout))

    def _check_frames(self) -> None:
        """Frames `[F, H, W, C]` must fill the grid exactly: t = ceil(F / temporal), H = h * patch, W = w * patch."""
        (t, h, w), (patch, merge, temporal) = self.grid_thw, self.spec.layout
        shape = tuple(self.frames.shape)
        if (self.frames.dim() != 4 or self.frames.dtype != torch.uint8 or h % merge or w % merge
                or shape[1:3] != (h * patch, w * patch) or -(-shape[0] // temporal) != t
                or shape[3] != self.spec.table.shape[0]):
            raise InputError(f"{self.kind} frames {shape} {self.frames.dtype} do not fill grid "
                             f"{self.grid_thw} with (patch, merge, temporal) {self.spec.layout}")

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)

    def positions(self) -> np.ndarray:
        """[num_tokens] prompt positions of the placeholders, feature row order."""
        return np.concatenate([np.arange(s, e) for s, e in self.spans]) if self.spans else np.zeros(0, np.int64)

    def model_input(self, device, dtype: torch.dtype) -> torch.Tensor:
        """[N_patch, C * temporal * p * p] in `dtype` on `device`: the frames moved as uint8 (4x fewer
        bytes than float32 patches), then normalised and laid out there (`normalize_frames`)."""
        patch, merge, temporal = self.spec.layout
        return normalize_frames(self.frames.to(device), self.spec.table.to(device=device, dtype=dtype),
                                patch=patch, merge=merge, temporal=temporal)


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


def split_media(ids, types, out: dict, index: int, keep: torch.Tensor, merge: int, temporal: int = 2):
    """MediaItems of prompt `index` (positions after removing padding) from the processor's packed
    float patches, converted to the shipped form at this boundary (`patches_to_frames`: exact)."""
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
            name = "image" if kind_ == 1 else "video"
            frames, spec = patches_to_frames(pv, (t, h, w), merge, temporal, still=name == "image")
            items.append(MediaItem(name, frames, (t, h, w), tuple(spans), spec))
            offsets[kind_] += t * h * w
            counters[kind_] += 1
            pending = None
    if pending is not None:
        raise InputError(f"{pending[2]} placeholders missing for a grid {pending[1]}")
    return tuple(items)
