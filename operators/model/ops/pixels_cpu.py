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
    _kernel(frames.numpy(), table.numpy(), patch, merge, temporal, out.numpy())
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def _kernel(frames, table, p, m, tp, out):  # pragma: no cover - compiled; shapes as above
    f, h, w, c = frames.shape
    bh_n, bw_n = h // (p * m), w // (p * m)
    pp = p * p
    n = 0
    for t in range(out.shape[0] // (bh_n * bw_n * m * m)):
        for bh in range(bh_n):
            for bw in range(bw_n):
                for mh in range(m):
                    for mw in range(m):
                        _patch(frames, table, t, (bh * m + mh) * p, (bw * m + mw) * p, p, tp, f, c, pp, out[n])
                        n += 1


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _patch(frames, table, t, y0, x0, p, tp, f, c, pp, row):  # pragma: no cover - compiled
    """One patch row [C * tp * p * p] from pixel (y0, x0) of temporal group t."""
    for ch in range(c):
        lut = table[ch]
        for tt in range(tp):
            fi = min(t * tp + tt, f - 1)
            base = (ch * tp + tt) * pp
            if tt > 0 and fi == min(t * tp + tt - 1, f - 1):  # the same frame again: copy its slot
                row[base: base + pp] = row[base - pp: base]
                continue
            for py in range(p):
                src = frames[fi, y0 + py]
                o = base + py * p
                for px in range(p):
                    row[o + px] = lut[src[x0 + px, ch]]
