"""MRoPE position ids `[3, B, L]` and rope deltas `[B]` (seed 000 section 11).

Owns the (t, h, w) coordinates of every prompt token, computed exactly as
transformers 5.23 `Qwen3_5Model.get_rope_index`:

- the valid tokens of a row (attention_mask 1) are split into maximal runs of
  equal `mm_token_type_ids` (0 text, 1 image, 2 video);
- a text run of n tokens gets `pos .. pos+n-1` on all three axes; pos += n;
- a vision run takes the next grid of its modality; video grids `[T, H, W]` are
  first split into T grids `[1, H, W]` (one per temporal group, since timestamp
  text separates the groups); with merge m the run gets t = pos + k,
  h = pos + i, w = pos + j over `[T, H/m, W/m]`; pos += max(H, W) / m;
- padding positions stay 0; `rope_delta = max(position) + 1 - n_valid`.

The decoder uses `position = index + rope_delta` for tokens generated later.
"""
from __future__ import annotations

import numpy as np

from vlbatch.operators.errors import InputError


def _runs(types: np.ndarray) -> list[tuple[int, int, int]]:
    """[(type, start, end)] maximal runs of equal values in a 1-D array."""
    if types.size == 0:
        return []
    cuts = np.flatnonzero(types[1:] != types[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [types.size]])
    return [(int(types[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def _vision_positions(start: int, grid: np.ndarray, merge: int) -> np.ndarray:
    """[3, T*(H/m)*(W/m)] coordinates of one vision run starting at `start`."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    out = np.empty((3, t, h, w), np.int64)  # broadcast writes: ~10x faster than meshgrid + stack
    out[0] = np.arange(start, start + t)[:, None, None]
    out[1] = np.arange(start, start + h)[None, :, None]
    out[2] = np.arange(start, start + w)
    return out.reshape(3, -1)


def split_video_grids(video_grid_thw: np.ndarray | None) -> np.ndarray | None:
    """[Nv, 3] -> [sum T, 3]: one `[1, H, W]` grid per temporal group."""
    if video_grid_thw is None:
        return None
    grids = np.repeat(np.asarray(video_grid_thw, dtype=np.int64), np.asarray(video_grid_thw)[:, 0], axis=0)
    grids[:, 0] = 1
    return grids


def mrope_position_ids(
    mm_token_type_ids: np.ndarray,
    image_grid_thw: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    attention_mask: np.ndarray | None = None,
    *,
    spatial_merge_size: int = 2,
) -> tuple[np.ndarray, np.ndarray]:
    """Position ids int64 `[3, B, L]` and rope deltas int64 `[B]`.

    mm_token_type_ids: int `[B, L]`; image_grid_thw `[Ni, 3]` and video_grid_thw
    `[Nv, 3]` in prompt order across the batch; attention_mask `[B, L]` or None.
    Raises `InputError` when a vision run does not hold exactly its grid's tokens
    or grids run out (the prompt's placeholders and the media disagree).
    """
    types = np.asarray(mm_token_type_ids)
    b, length = types.shape
    grids = {1: iter(()) if image_grid_thw is None else iter(np.asarray(image_grid_thw)),
             2: iter(()) if video_grid_thw is None else iter(split_video_grids(video_grid_thw))}
    positions = np.zeros((3, b, length), dtype=np.int64)
    deltas = np.zeros(b, dtype=np.int64)
    for row in range(b):
        valid = np.ones(length, dtype=bool) if attention_mask is None else np.asarray(attention_mask[row]).astype(bool)
        pieces, pos = [], 0
        for kind, start, end in _runs(types[row][valid]):
            n = end - start
            if kind == 0:
                pieces.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
                pos += n
                continue
            grid = next(grids[kind], None)
            if grid is None:
                raise InputError(f"row {row}: more {'image' if kind == 1 else 'video'} token runs than media grids")
            block = _vision_positions(pos, grid, spatial_merge_size)
            if block.shape[1] != n:
                raise InputError(f"row {row}: a vision run of {n} tokens does not match its grid {grid.tolist()}")
            pieces.append(block)
            pos += max(int(grid[1]), int(grid[2])) // spatial_merge_size
        if not pieces:
            continue
        row_pos = np.concatenate(pieces, axis=1)
        positions[:, row, valid] = row_pos
        deltas[row] = row_pos.max() + 1 - int(valid.sum())
    return positions, deltas
