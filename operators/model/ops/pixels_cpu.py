"""uint8 frames -> normalised patches in the processor's layout as one compiled pass (numba).

Same contract as `pixels.normalize_frames_torch` (the twin beside it; every other device, dtype
and layout takes it): frames `[F, H, W, C]` uint8, table `[C, 256]` ->
`[N, C * tp * p * p]` with

    out[n, ((c * tp + tt) * p + py) * p + px] = table[c, frames[f, y, x, c]]

n the patch in block-major order (temporal group, m x m merge block, patch in block),
f = min(group * tp + tt, F - 1) (an odd count repeats the last frame, a still image fills
every slot), (y, x) the pixel of patch row py, column px. The torch form makes four passes
(int32 indices, their channel offsets, the lookup, the float32 layout copy: 1.5 ms for a
512 x 384 image on one core); here each value is looked up once and written once, a
repeated frame's slot copied from the slot before (0.6 ms). A lookup and a copy: equal to
the twin bit for bit (tests/test_model_pixels_cpu.py).
"""
from __future__ import annotations

import torch
from numba import njit


def usable(frames: torch.Tensor, table: torch.Tensor) -> bool:
    """CPU, contiguous uint8 frames and a float32 table (the kernel reads numpy views)."""
    return (frames.is_cpu and table.is_cpu and table.dtype is torch.float32 and frames.is_contiguous()
            and table.is_contiguous())


def warm_up() -> None:
    """Load (or compile and cache) the kernel at model load: the first image is not the JIT's."""
    normalize_frames_cpu(torch.zeros(1, 4, 4, 1, dtype=torch.uint8), torch.zeros(1, 256), patch=2, merge=2,
                         temporal=2)


def normalize_frames_cpu(frames: torch.Tensor, table: torch.Tensor, *, patch: int, merge: int,
                         temporal: int) -> torch.Tensor:
    """frames [F, H, W, C] uint8, table [C, 256] float32 (`usable`; H, W multiples of
    patch * merge, checked by the caller) -> [N, C * temporal * patch^2] float32."""
    f, h, w, c = frames.shape
    n = -(-f // temporal) * (h // patch) * (w // patch)
    out = torch.empty(n, c * temporal * patch * patch, dtype=torch.float32)
    patches_kernel(frames.numpy(), table.numpy(), out.numpy(), patch, merge, temporal)
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def patches_kernel(frames, lut, out, patch, merge, temporal):  # pragma: no cover - compiled
    """frames u8 [F, H, W, C] (C-contiguous); lut f32 [C, 256]; out f32 [N, C*temporal*patch*patch]:
    every value of the block-major layout written once through the lookup. The CPU stage's
    `preprocess.patchify_into` runs it too (the model side is the layer below)."""
    f_n, h, w, c_n = frames.shape
    groups = (f_n + temporal - 1) // temporal
    bh_n, bw_n = h // (patch * merge), w // (patch * merge)
    pp = patch * patch
    row = 0
    for g in range(groups):
        for bh in range(bh_n):
            for bw in range(bw_n):
                for mh in range(merge):
                    for mw in range(merge):
                        y0 = (bh * merge + mh) * patch
                        x0 = (bw * merge + mw) * patch
                        o = out[row]
                        for c in range(c_n):
                            table = lut[c]
                            for t in range(temporal):
                                src = min(g * temporal + t, f_n - 1)
                                base = (c * temporal + t) * pp
                                if t > 0 and src == min(g * temporal + t - 1, f_n - 1):
                                    o[base:base + pp] = o[base - pp:base]  # repeated frame: copy the slot
                                    continue
                                for py in range(patch):
                                    line = frames[src, y0 + py]
                                    d = base + py * patch
                                    for px in range(patch):
                                        o[d + px] = table[line[x0 + px, c]]
                        row += 1
