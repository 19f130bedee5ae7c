"""The vision tower's per-grid tables (positions, rope cos / sin; `model/vision.GridTables`):
served from the cache they give the outputs of freshly made ones, new position weights make
new tables, several items in one call equal each alone, and the cache stays within its bytes."""
from __future__ import annotations

import pytest
import torch

from vlbatch.operators.model import load_model
from vlbatch.operators.model.vision import GridTables


@pytest.fixture(scope="module")
def tower(tiny_ckpt):
    return load_model(tiny_ckpt("dense")).visual


def _pixels(tower, t, h, w, seed):
    cfg = tower.cfg
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return torch.randn(t * h * w, width, generator=torch.Generator().manual_seed(seed))


def _fresh(tower, pixels, grid):
    saved, tower.grid_tables = tower.grid_tables, GridTables()
    try:
        return tower(pixels, grid)
    finally:
        tower.grid_tables = saved


@torch.inference_mode()
def test_cached_tables_give_the_fresh_outputs_and_follow_the_weights(tower):
    grid = torch.tensor([[1, 6, 4]])
    px = _pixels(tower, 1, 6, 4, seed=0)
    first = tower(px, grid)
    assert any(k[:2] == (6, 4) for k in tower.grid_tables._entries)
    assert torch.equal(tower(px, grid), first) and torch.equal(_fresh(tower, px, grid), first)
    weight = tower.pos_embed.weight
    saved = weight.clone()
    try:
        weight.mul_(2.0)  # a reload writes the table in place: the cached positions are stale
        changed = tower(px, grid)
        assert not torch.equal(changed, first) and torch.equal(changed, _fresh(tower, px, grid))
    finally:
        weight.copy_(saved)


@torch.inference_mode()
def test_items_together_equal_each_alone(tower):
    grids = [(1, 6, 4), (3, 4, 4), (1, 6, 4)]  # a repeated size, and a video of three temporal groups
    pxs = [_pixels(tower, *g, seed=i) for i, g in enumerate(grids)]
    together = tower(torch.cat(pxs), torch.tensor(grids))
    alone = torch.cat([tower(p, torch.tensor([g])) for p, g in zip(pxs, grids, strict=True)])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=0)


def test_tables_stay_within_their_bytes_oldest_out_first():
    cache = GridTables(max_bytes=3 * 400)
    entry = lambda: (torch.zeros(100), torch.zeros(0))  # noqa: E731  400 bytes
    for key in "abc":
        cache.put(key, entry())
    assert cache.nbytes == 1200 and cache.get("a") is not None
    cache.put("d", entry())
    assert cache.get("a") is None and all(cache.get(k) is not None for k in "bcd") and cache.nbytes == 1200
    cache.put("huge", (torch.zeros(400),))  # larger than the whole cache: not kept, nothing dropped
    assert cache.get("huge") is None and cache.nbytes == 1200 and cache.get("b") is not None
