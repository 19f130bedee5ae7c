"""Per-visual-token targets for the auxiliary vision loss of the shapes training.

From scratch, a tiny vision tower trained only through the language loss collapses
(measured last session: per-token spread 27% -> 3% in 200 steps) and a frozen
random one carries too little colour (a ridge probe on its shape tokens reads the
colour of a single shape 35% of the time, chance 17%). So training adds dense
supervision: every merged visual token (the merger's output, one row per
`spatial_merge_size**2` patches, in the reference's order) gets a target for the
colour, kind and size of the shape covering most of it, or "none" for background.
The targets are read off the rendered pixels: a pixel is a shape pixel when it is
within `COLOUR_TOLERANCE` of a vocabulary colour (backgrounds are low-saturation,
shapes saturated, see `scenes.draw`); image pixels go to the nearest shape centre of
that colour. Video tokens get colour targets only (kinds would need tracking).

Every token also gets its own place in the frame, as row and column bins
(`POSITION_BINS` per axis): the decoder's MRoPE carries the visual grid only in its
lowest frequencies (theta 1e7, 8 rotary frequencies: the width axis turns 0.018 rad
per token), and a run without these targets answered "where" questions at chance
(9/35 on held-out captions and questions at step 1000), so the tower is taught to
write each token's place into its feature.

Video shape tokens also get the motion of their shape (`0 = none, 1 = still, 2.. =
DIRECTIONS`): a temporal patch holds two frames 0.5 s apart, over which a moving shape
shifts 6-15% of the frame, so the tower can see the direction locally; the decoder then
reads it like a colour (without it, held-out motion answers were 35% right at step 2000).

Targets per token `[N, 6]`: colour `0 = none, 1.. = COLOURS order`; kind `0 = none,
1.. = KINDS`; size `0 = none, 1.. = SIZES`; row bin and column bin `0..POSITION_BINS-1`;
motion (videos; IGNORE on images). `IGNORE` marks a token too mixed to label
(shape coverage between `MIN_PART` and `MIN_COVER`), except that every shape labels the
token holding most of it, so small shapes split over token borders are never unlabelled.
"""
from __future__ import annotations

import numpy as np

from vlbatch.devtools.scenes.vocab import COLOURS, DIRECTIONS, KINDS, SIZES, STILL

IGNORE = -100
COLOUR_TOLERANCE = 45  # max per-channel distance of a shape pixel from its vocabulary colour (jitter is 12)
MIN_COVER = 0.2  # a token is a shape's when the shape covers at least this fraction of it
MIN_PART = 0.04  # below this coverage a token is background
POSITION_BINS = 6  # per axis: 2 per third, so "left" / "center" / "right" and motion both read off
STRIDE = 2  # labels are read off every 2nd pixel per axis (coverage fractions are scale-free)
N_COLOUR, N_KIND, N_SIZE = len(COLOURS) + 1, len(KINDS) + 1, len(SIZES) + 1
N_MOTION = len(DIRECTIONS) + 2  # none, still, directions
_RGB = np.asarray(list(COLOURS.values()), dtype=np.int16)  # [6, 3]


def colour_classes(img: np.ndarray) -> np.ndarray:
    """`[H, W, 3] uint8` -> `[H, W] int` colour class per pixel (0 = no vocabulary colour)."""
    px = img.astype(np.int16)
    best = np.zeros(img.shape[:2], dtype=np.int64)
    best_d = np.full(img.shape[:2], np.iinfo(np.int16).max, dtype=np.int16)
    for i, rgb in enumerate(_RGB):  # one pass per colour over [H, W] planes (a 4-D reduce is ~10x slower)
        d = np.maximum(np.maximum(np.abs(px[..., 0] - rgb[0]), np.abs(px[..., 1] - rgb[1])),
                       np.abs(px[..., 2] - rgb[2]))
        better = d < best_d
        best[better] = i + 1
        best_d = np.minimum(best_d, d)
    return np.where(best_d <= COLOUR_TOLERANCE, best, 0)


def _coverage(masks: np.ndarray, grid_hw: tuple[int, int]) -> np.ndarray:
    """`[S, H, W]` float masks -> `[S, gh, gw]` fraction of each token covered (area pooling)."""
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(masks.astype(np.float32))[None]
    return F.interpolate(t, size=grid_hw, mode="area")[0].numpy()


def _labels(cover: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Coverage `[S, gh, gw]` of S regions with class ids `[S]` -> `[gh * gw]` targets."""
    if cover.shape[0] == 0:
        return np.zeros(cover.shape[1] * cover.shape[2], dtype=np.int64)
    best = cover.argmax(axis=0)
    frac = cover.max(axis=0)
    out = np.where(frac >= MIN_COVER, classes[best], IGNORE)
    out = np.where(cover.sum(axis=0) < MIN_PART, 0, out)
    for s in range(cover.shape[0]):  # a small shape split over tokens still labels the token holding most of it
        at = np.unravel_index(cover[s].argmax(), frac.shape)
        if cover[s][at] >= MIN_PART and out[at] in (IGNORE, 0):
            out[at] = classes[s]
    return out.reshape(-1).astype(np.int64)


def position_targets(t: int, gh: int, gw: int) -> np.ndarray:
    """`[t * gh * gw, 2]` (row bin, column bin) of every merged token, time-major, row-major."""
    rows = (np.arange(gh) * POSITION_BINS) // gh
    cols = (np.arange(gw) * POSITION_BINS) // gw
    grid = np.stack(np.meshgrid(rows, cols, indexing="ij"), axis=-1).reshape(-1, 2)
    return np.tile(grid, (t, 1)).astype(np.int64)


def token_grid(grid_thw, merge: int = 2) -> tuple[int, int, int]:
    """Patch grid `(t, h, w)` -> merged token grid `(t, h / merge, w / merge)`."""
    t, h, w = (int(v) for v in grid_thw)
    return t, h // merge, w // merge


def image_targets(scene, grid_thw) -> np.ndarray:
    """`[N, 6]` (colour, kind, size, row, column, motion=IGNORE) targets of an image scene's N merged
    tokens, row-major."""
    img = scene.image[::STRIDE, ::STRIDE]
    h, w = img.shape[:2]
    cls = colour_classes(img)
    ys, xs = np.mgrid[0:h, 0:w]
    colour_ids = {name: i + 1 for i, name in enumerate(COLOURS)}
    dist = np.stack([(xs - s.cx * w) ** 2 + (ys - s.cy * h) ** 2 for s in scene.shapes])  # [S, H, W]
    same = np.stack([cls == colour_ids[s.colour] for s in scene.shapes])
    nearest = np.where(same, dist, np.inf).argmin(axis=0)
    masks = np.stack([same[i] & (nearest == i) for i in range(len(scene.shapes))])
    _, gh, gw = token_grid(grid_thw)
    cover = _coverage(masks, (gh, gw))
    colour = _labels(cover, np.array([colour_ids[s.colour] for s in scene.shapes]))
    kind = _labels(cover, np.array([KINDS.index(s.kind) + 1 for s in scene.shapes]))
    size = _labels(cover, np.array([SIZES.index(s.size) + 1 for s in scene.shapes]))
    motion = np.full_like(colour, IGNORE)
    return np.concatenate([np.stack([colour, kind, size], axis=1), position_targets(1, gh, gw), motion[:, None]],
                          axis=1)


def _motion_of_colours(shapes) -> np.ndarray:
    """`[N_COLOUR]` motion class a token of each colour class gets (IGNORE when shapes of that colour disagree)."""
    out = np.full(N_COLOUR, IGNORE, dtype=np.int64)
    out[0] = 0
    for c, name in enumerate(COLOURS, start=1):
        motions = {s.motion for s in shapes if name in (s.colour_start, s.colour_end)}
        if len(motions) == 1:
            m = motions.pop()
            out[c] = 1 if m == STILL else 2 + DIRECTIONS.index(m)
    return out


def video_targets(frames: np.ndarray, grid_thw, shapes=(), temporal_patch: int = 2) -> np.ndarray:
    """`[N, 6]` targets of a clip's merged tokens (kind and size IGNORE), time-major.

    `shapes` are the scene's `VideoShape`s (motion targets are IGNORE without them).

    `frames [F, H, W, 3]` are the sampled frames the processor receives; it pads F up to a
    multiple of `temporal_patch` by repeating the last frame, and so does this.
    """
    t, gh, gw = token_grid(grid_thw)
    rows = []
    for ti in range(t):
        idx = [min(ti * temporal_patch + k, len(frames) - 1) for k in range(temporal_patch)]
        cls = np.stack([colour_classes(frames[i, ::STRIDE, ::STRIDE]) for i in idx])  # [tp, H, W]
        masks = np.stack([(cls == c).mean(axis=0) for c in range(1, N_COLOUR)])  # [6, H, W]
        rows.append(_labels(_coverage(masks, (gh, gw)), np.arange(1, N_COLOUR)))
    colour = np.concatenate(rows)
    rest = np.full_like(colour, IGNORE)
    motion = _motion_of_colours(shapes)[np.where(colour == IGNORE, 0, colour)] if shapes else rest
    motion = np.where(colour == IGNORE, IGNORE, motion)
    return np.concatenate([np.stack([colour, rest, rest], axis=1), position_targets(t, gh, gw), motion[:, None]],
                          axis=1)
