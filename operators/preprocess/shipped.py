"""The shipped media: what the CPU stage hands to the model stage, and what the engine sees.

One module owns the form (ARCHITECTURE.md, "Data flow"): a media reaches the engine as

    frames   uint8 `[F, h, w, 3]`, the resized frames (F = 1 for an image), as the
             processor's `encode_media(..., frames=True)` makes them;
    grid     (t, h, w) in patches: t = ceil(F / temporal), h * patch, w * patch the frame size;
    spec     `PixelSpec`: the checkpoint's normalisation table float32 `[3, 256]` and the
             layout (patch, merge, temporal) that make the frames the tower's float patches
             (`vlbatch.operators.model.pixels.normalize_frames`, on the model's device);
    hash     `media_hash`: BLAKE3 over kind, grid, layout, frames and table (the CPU stage
             computes it once; the vision and prefix caches key on it);

and each prompt adds its placeholder spans (`MediaItem`, `operators/engine/media_spans.py`).

The deferred decode (`video.decode_device: cuda | model-cpu`) ships the same media one step
earlier: the encoded bytes and a `DecodePlan` (the sampled indices over the frames the
video holds, the resized size), from which the CPU stage built the prompt's grid, spans and
positions exactly as for decoded frames (`Processor.plan_media`). The model stage resolves
the plan into frames before the engine sees the media (`DecodePlan.frames`): decode with
TorchCodec on the decode device, then the CPU path's own resize (`visual._resized`, bit for
bit the CPU stage's frames: CUDA's bicubic antialias resize is not the CPU uint8 kernel, so
decoded frames come back to the host for it). Its hash covers the bytes and the plan
(`plan_hash`): equal inputs give equal keys; the same frames reached from other bytes are
a cache miss, never a false hit.

Other callers (parity tests, benchmarks) build requests from the reference processor's
float patches; `Request.from_processor` converts those at its boundary (`patches_to_frames`).
"""
from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np
import torch

from vlbatch.operators.errors import InputError


@dataclass(frozen=True, eq=False)
class PixelSpec:
    """How one media kind's frames become the tower's input: the normalisation table float32
    `[C, 256]` (`Normalization.lut`) and the layout (patch, merge, temporal) (`frames_to_patches`)."""

    table: torch.Tensor
    layout: tuple[int, int, int]

    @classmethod
    def of(cls, cfg) -> PixelSpec:
        """The spec of an `ImageConfig` / `VideoConfig` (`operators/preprocess/config.py`)."""
        return cls(torch.from_numpy(cfg.norm.lut(3)), cfg.layout)


def pixel_specs(model_dir: str) -> dict[str, PixelSpec]:
    """The checkpoint's `PixelSpec` per media kind (the tables the CPU stage's processor hashes
    with: a job overrides only pixel budgets)."""
    from vlbatch.operators.preprocess.config import load_image_config, load_video_config

    return {"image": PixelSpec.of(load_image_config(model_dir)), "video": PixelSpec.of(load_video_config(model_dir))}


def media_hash(kind: str, frames, grid_thw: tuple[int, int, int], table=None,
               layout: tuple[int, int, int] | None = None) -> str:
    """BLAKE3 over kind, grid, layout, dtype, shape, the raw pixel bytes (torch or numpy) and the
    normalisation table `[C, 256]`: equal iff the vision input is equal.

    BLAKE3 (a cryptographic hash, ~3.5x sha256's speed here: 0.14 ms for a 640x480 frame)
    because the key stands for the pixels in the vision and prefix caches: a collision would
    give one media another's features, so a crafted pair must not collide either (xxh3 is
    9x faster still, but not collision-resistant)."""
    dtype, shape, data = _pixel_bytes(frames)
    h = blake3.blake3(f"{kind}|{tuple(int(v) for v in grid_thw)}|{layout}|{dtype}|{shape}|".encode())
    h.update(data)
    if table is not None:
        t = table.detach().cpu().numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
        h.update(b"|table|" + np.ascontiguousarray(t, dtype=np.float32).tobytes())
    return h.hexdigest()


def _pixel_bytes(x) -> tuple[str, tuple[int, ...], memoryview | bytes]:
    """(dtype name, shape, raw bytes) of a numpy array or a tensor: the buffer itself when contiguous."""
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous().cpu()
        data = x.reshape(-1).view(torch.uint8).numpy().data if x.numel() else b""
        return str(x.dtype).removeprefix("torch."), tuple(x.shape), data
    a = np.ascontiguousarray(x)
    return a.dtype.name, a.shape, a.reshape(-1).view(np.uint8).data if a.size else b""


@dataclass(frozen=True)
class DecodePlan:
    """A video shipped undecoded: the frames at `indices` of the `total_frames` it holds,
    resized to `size` (h, w); the grid and spans of its prompts were built from this plan."""

    indices: tuple[int, ...]
    total_frames: int
    size: tuple[int, int]

    @classmethod
    def of(cls, indices, total_frames: int, grid_thw, layout: tuple[int, int, int]) -> DecodePlan:
        """The plan whose frames fill `grid_thw` under `layout` (h = grid h * patch, as the CPU stage resized)."""
        patch = layout[0]
        size = (int(grid_thw[1]) * patch, int(grid_thw[2]) * patch)
        plan = cls(tuple(int(i) for i in indices), int(total_frames), size)
        if not plan.indices or -(-len(plan.indices) // layout[2]) != int(grid_thw[0]):
            raise InputError(f"a decode plan of {len(plan.indices)} frames does not fill grid {tuple(grid_thw)}")
        return plan

    def frames(self, data: bytes, device: str) -> torch.Tensor:
        """uint8 `[F, h, w, 3]` on the CPU: the frames the CPU stage would have shipped, bit for bit
        (decoded by TorchCodec on `device`, "cpu" or "cuda[:N]", then the CPU path's resize)."""
        from vlbatch.operators.media.gpu_decode import decode_planned
        from vlbatch.operators.preprocess.visual import _resized

        decoded = decode_planned(data, self.indices, self.total_frames, device)  # [F, H, W, 3] on device
        resized = np.ascontiguousarray(_resized(decoded.cpu().numpy(), self.size))
        return torch.from_numpy(resized)


def plan_hash(kind: str, data: bytes, plan: DecodePlan, grid_thw, spec_table, layout) -> str:
    """The content hash of a media shipped as bytes + plan (`media_hash`'s role: equal keys, equal input)."""
    h = blake3.blake3(f"plan|{kind}|{tuple(int(v) for v in grid_thw)}|{layout}|{plan}|".encode())
    h.update(memoryview(data))
    h.update(b"|table|" + np.ascontiguousarray(np.asarray(spec_table), dtype=np.float32).tobytes())
    return h.hexdigest()


def patches_to_frames(values, grid_thw, merge: int, temporal: int = 2, *,
                      still: bool = False) -> tuple[torch.Tensor, PixelSpec]:
    """The reference processor's packed patches of one media, float `[N, C * temporal * p * p]`
    (`pixel_values`), as the shipped form: uint8 frames `[F, h * p, w * p, C]` and a `PixelSpec`
    whose table holds each channel's distinct values, so `normalize_frames(frames, spec.table)`
    gives `values` back bit for bit (the processor's values are one of 256 levels per channel:
    `Normalization.lut`). The inverse of `frames_to_patches`: F = t * temporal (a video's padded
    last group keeps its repeated frame; equal patches either way); `still`: an image, whose
    temporal slots repeat one frame, gives F = 1. `InputError` for values that are no processor's
    (more than 256 distinct values in a channel) or a size the grid does not divide."""
    x = torch.as_tensor(np.asarray(values)) if not isinstance(values, torch.Tensor) else values
    t, h, w = (int(v) for v in grid_thw)
    n, d = x.shape
    patch = round((d / (3 * temporal)) ** 0.5)
    if n != t * h * w or 3 * temporal * patch * patch != d or h % merge or w % merge:
        raise InputError(f"pixel values [{n}, {d}] do not fill grid {(t, h, w)} "
                         f"with merge {merge}, temporal {temporal}")
    x = x.reshape(t, h // merge, w // merge, merge, merge, 3, temporal, patch, patch)
    x = x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8)  # [t, tp, C, bh, mh, p, bw, mw, p]: frames_to_patches undone
    frames = x.reshape(t * temporal, 3, h * patch, w * patch).permute(0, 2, 3, 1)  # [F, H, W, C]
    if still and bool((frames == frames[:1]).all()):
        frames = frames[:1]
    table = torch.empty(3, 256, dtype=torch.float32)
    codes = torch.empty(frames.shape, dtype=torch.uint8)
    for c in range(3):
        levels, index = torch.unique(frames[..., c].float(), sorted=True, return_inverse=True)
        if levels.numel() > 256:
            raise InputError(f"channel {c} holds {levels.numel()} distinct values: not a processor's pixel values "
                             "(at most 256 levels per channel)")
        table[c, :levels.numel()] = levels
        table[c, levels.numel():] = levels[-1]
        codes[..., c] = index.to(torch.uint8)
    return codes, PixelSpec(table, (patch, merge, temporal))
