"""MRoPE position ids (t, h, w) of a token sequence holding images and videos (seed 000 section 11).

The sequence is cut into runs of equal `mm_token_type_ids` (0 text, 1 image, 2 video).
A text run of n tokens takes positions p .. p + n - 1 on all three axes. A visual run
takes the next grid: a video [T, H, W] counts as T grids [1, H, W] (its frames are
separated by timestamp text), an image is one grid. With merged sizes h = H / m,
w = W / m, the run's tokens get t = p, h-axis p + row, w-axis p + col (row-major
over the merged grid), and p advances by max(h, w). `rope_delta = max position + 1 - L`
gives the decode positions: token i >= L sits at i + rope_delta on every axis.
"""
from __future__ import annotations

import itertools

import torch

from vlbatch.operators.errors import InputError


def mm_token_types(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """[B, L] ids -> [B, L] types: 1 at image placeholders, 2 at video placeholders, else 0."""
    types = torch.zeros_like(input_ids)
    types[input_ids == image_token_id] = 1
    types[input_ids == video_token_id] = 2
    return types


def mrope_positions(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mm_token_type_ids [B, L] -> (position_ids [3, B, L] long, rope_deltas [B] long).

    Grids are consumed in order across the whole batch (images and videos separately).
    """
    b, length = mm_token_type_ids.shape
    grids = {
        1: iter(image_grid_thw.tolist() if image_grid_thw is not None else []),
        2: iter(_frames(video_grid_thw)),
    }
    positions = torch.zeros(3, b, length, dtype=torch.long)
    deltas = torch.zeros(b, dtype=torch.long)
    for row, types in enumerate(mm_token_type_ids.tolist()):
        parts, cur, start = [], 0, 0
        for kind, run in itertools.groupby(types):
            n = len(list(run))
            if kind == 0:
                parts.append(torch.arange(cur, cur + n).expand(3, n))
                cur += n
            else:
                grid = next(grids[kind], None)
                if grid is None:
                    raise InputError(f"more {'image' if kind == 1 else 'video'} token runs than grids")
                t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
                if t * h * w != n:
                    raise InputError(f"a run of {n} visual tokens does not match grid {grid} (expects {t * h * w})")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
                cur += max(h, w)
            start += n
        pos = torch.cat(parts, dim=1)
        positions[:, row] = pos
        deltas[row] = int(pos.max()) + 1 - length
    for kind, it in grids.items():
        if next(it, None) is not None:
            raise InputError(f"more {'image' if kind == 1 else 'video'} grids than token runs")
    return positions.to(mm_token_type_ids.device), deltas.to(mm_token_type_ids.device)


def _frames(video_grid_thw: torch.Tensor | None) -> list[list[int]]:
    """Each video [T, H, W] as T single-frame grids [1, H, W]."""
    if video_grid_thw is None:
        return []
    return [[1, h, w] for t, h, w in video_grid_thw.tolist() for _ in range(t)]
