"""Engine data structures without a model: blocks, state pool, keys, planning, vision cache (the prefix
caches and the planner: tests/test_engine_prefix_cache.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vlbatch.operators.engine.caches.block_manager import BlockManager, blocks_for_budget, kv_bytes_per_block
from vlbatch.operators.engine.caches.branch_points import plan_branch_points, plan_branch_points_naive
from vlbatch.operators.engine.caches.prefix_cache import KeyCodec
from vlbatch.operators.engine.caches.state_pool import StatePool
from vlbatch.operators.engine.caches.vision_cache import LRUVisionCache
from vlbatch.operators.engine.request import MediaItem
from vlbatch.operators.errors import ConfigError, InputError


# -- block manager ---------------------------------------------------------------------------
def test_blocks_refcount_and_free_list():
    bm = BlockManager(4, 8)
    a = bm.allocate(3)
    assert bm.num_free == 1 and all(bm.refcount(b) == 1 for b in a)
    bm.incref(a[:1])
    bm.decref(a)
    assert bm.num_free == 3 and bm.refcount(a[0]) == 1  # still shared once
    bm.decref(a[:1])
    assert bm.num_free == 4
    with pytest.raises(RuntimeError):
        bm.decref(a[:1])
    with pytest.raises(MemoryError):
        bm.allocate(5)


def test_grow_table_and_budget():
    bm = BlockManager(5, 4)
    table: list[int] = []
    assert len(bm.grow_table(table, 1)) == 1 and len(table) == 1
    assert bm.grow_table(table, 4) == [] and len(table) == 1  # positions 0..3 fit in one block
    bm.grow_table(table, 9)
    assert len(table) == 3
    with pytest.raises(MemoryError):
        bm.grow_table(table, 100)
    assert len(table) == 3  # unchanged on failure
    per = kv_bytes_per_block(16, 2, 2, 64, 4)
    assert per == 2 * 16 * 2 * 2 * 64 * 4
    assert blocks_for_budget(10 * per + per // 2, per) == 10
    with pytest.raises(ConfigError):
        blocks_for_budget(per - 1, per)


# -- state pool ------------------------------------------------------------------------------
def _pool(slots=3):
    return StatePool(slots, num_linear=2, conv_dim=6, conv_kernel=4, num_v_heads=2, k_dim=3, v_dim=5)


def test_state_pool_snapshot_is_an_isolated_copy():
    pool = _pool()
    s = pool.allocate()
    pool.scatter(1, torch.tensor([s]), torch.ones(1, 6, 4), torch.full((1, 2, 3, 5), 2.0))
    snap = pool.snapshot(s)
    pool.scatter(1, torch.tensor([s]), torch.zeros(1, 6, 4), torch.zeros(1, 2, 3, 5))  # keep decoding
    assert snap.conv[1].eq(1).all() and snap.recurrent[1].eq(2).all()
    t = pool.allocate()
    pool.restore(t, snap)
    conv, rec = pool.gather(1, torch.tensor([t, s]))
    assert conv[0].eq(1).all() and rec[0].eq(2).all() and rec[1].eq(0).all()
    pool.scatter(1, torch.tensor([t]), torch.full((1, 6, 4), 7.0), rec[:1])
    assert snap.conv[1].eq(1).all()  # restoring did not alias the snapshot
    assert snap.nbytes == 2 * 6 * 4 * 4 + 2 * 2 * 3 * 5 * 4


def test_state_pool_slots_zeroed_and_bounded():
    pool = _pool(2)
    a = pool.allocate()
    pool.scatter(0, torch.tensor([a]), torch.ones(1, 6, 4), torch.ones(1, 2, 3, 5))
    pool.free(a)
    b = pool.allocate()
    pool.allocate()
    assert pool.gather(0, torch.tensor([b]))[0].eq(0).all()  # a reused slot starts from zeros
    with pytest.raises(MemoryError):
        pool.allocate()
    with pytest.raises(RuntimeError):
        pool.free(b) or pool.free(b)


# -- keys ------------------------------------------------------------------------------------
def _spec(layout=(2, 2, 2), **norm):
    from vlbatch.operators.preprocess.patchify import Normalization
    from vlbatch.operators.preprocess.shipped import PixelSpec

    return PixelSpec(torch.from_numpy(Normalization(**norm).lut(3)), layout)


def _item(seed, spans, grid=(1, 2, 4)):
    t, h, w = grid  # an image: one frame of h x w patches of 2 x 2 pixels
    frames = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (1, 2 * h, 2 * w, 3), dtype=np.uint8))
    return MediaItem("image", frames, grid, spans, _spec())


def test_keys_separate_media_with_equal_text():
    codec = KeyCodec()
    ids = [5, 6, 9, 9, 7]  # placeholders at 2..3 (same token id)
    a = codec.encode(ids, [_item(0, ((2, 4),))])
    b = codec.encode(ids, [_item(1, ((2, 4),))])
    c = codec.encode(ids, [_item(0, ((2, 4),))])
    assert (a[:2] == b[:2]).all() and (a[2:4] != b[2:4]).all() and (a[4:] == b[4:]).all()
    assert (a == c).all()
    assert (a[2:4] < 0).all() and a[2] != a[3]


def test_key_codec_forgetting_never_aliases():
    codec = KeyCodec(max_hashes=2)
    ids = [1, 9, 9, 2]
    first = codec.encode(ids, [_item(0, ((1, 3),))])
    for s in (1, 2, 3):
        codec.encode(ids, [_item(s, ((1, 3),))])  # pushes item 0's hash out
    again = codec.encode(ids, [_item(0, ((1, 3),))])
    others = [codec.encode(ids, [_item(s, ((1, 3),))]) for s in (1, 2, 3)]
    assert not (again == first).all()  # fresh id: a miss, not a false hit
    assert all(not (again[1:3] == o[1:3]).any() for o in others)


# -- planning --------------------------------------------------------------------------------
def test_branch_points_match_all_pairs_reference():
    rng = random.Random(0)
    for _ in range(200):
        keys = [np.array([rng.randint(0, 2) for _ in range(rng.randint(1, 9))]) for _ in range(rng.randint(1, 10))]
        assert plan_branch_points(keys) == plan_branch_points_naive(keys)
    sys_prompt, img_a, img_b = [1, 2, 3], [-5, -6], [-7, -8]
    keys = [np.array(sys_prompt + img + q) for img in (img_a, img_b) for q in ([10, 11], [12])]
    assert plan_branch_points(keys) == [(3, 5)] * 4  # end of system prompt, end of media


# -- vision cache ----------------------------------------------------------------------------
def test_vision_cache_lru_within_budget():
    vc = LRUVisionCache(budget_bytes=3 * 40)
    for k in "abc":
        vc.put(k, torch.zeros(10))  # 40 bytes each
    assert vc.get("a") is not None  # a is now most recent
    vc.put("d", torch.zeros(10))
    assert "b" not in vc and "a" in vc and vc.nbytes == 120
    vc.put("huge", torch.zeros(100))
    assert "huge" not in vc and len(vc) == 3
    assert (vc.hits, vc.misses) == (1, 0)


def test_media_item_validates_grid():
    with pytest.raises(InputError):  # 7 pixels high: not 2 patches of 2
        MediaItem("image", torch.zeros(1, 7, 8, 3, dtype=torch.uint8), (1, 2, 4), ((0, 2),), _spec())
    with pytest.raises(InputError):
        MediaItem("audio", torch.zeros(1, 4, 8, 3, dtype=torch.uint8), (1, 2, 4), ((0, 2),), _spec())
    with pytest.raises(InputError):  # float values are not the shipped form (`patches_to_frames` converts them)
        MediaItem("image", torch.zeros(1, 4, 8, 3), (1, 2, 4), ((0, 2),), _spec())


def test_state_pool_views_for_consecutive_slots_equal_copies():
    pool = _pool(4)
    slots = [pool.allocate() for _ in range(4)]
    torch.manual_seed(0)
    pool.conv.copy_(torch.randn_like(pool.conv))
    pool.recurrent.copy_(torch.randn_like(pool.recurrent))
    for idx in ([1, 2, 3], [0, 2]):
        t = torch.tensor([slots[i] for i in idx])
        run = StatePool.contiguous_run(t.tolist())
        assert (run is not None) == (idx == [1, 2, 3])
        c_view, r_view = pool.gather(0, t, run)
        c_copy, r_copy = pool.gather(0, t)
        assert torch.equal(c_view, c_copy) and torch.equal(r_view, r_copy)
        pool.scatter(0, t, c_copy + 1, r_copy * 2, run)
        assert torch.equal(pool.gather(0, t)[0], c_copy + 1) and torch.equal(pool.gather(0, t)[1], r_copy * 2)


def test_media_item_checks_its_grid_and_patchifies_on_the_device():
    """The one form: uint8 frames [F, H, W, C] with a `PixelSpec` (table, (patch, merge, temporal));
    the grid must match exactly, and `model_input` equals the uint8 patch form normalised
    (`frames_to_patches` + `normalize_patches`)."""
    from vlbatch.operators.model.pixels import frames_to_patches, normalize_patches

    frames = torch.from_numpy(np.random.default_rng(6).integers(0, 256, (3, 8, 16, 3), dtype=np.uint8))
    spec = _spec((4, 2, 2))  # patch 4, merge 2, temporal 2: 3 frames -> t = 2, grid (2, 2, 4)
    item = MediaItem("video", frames, (2, 2, 4), ((0, 4), (6, 10)), spec)
    patches = frames_to_patches(frames, patch=4, merge=2, temporal=2).contiguous()
    assert torch.equal(item.model_input("cpu", torch.float32), normalize_patches(patches, spec.table))
    assert item.model_input("cpu", torch.bfloat16).dtype == torch.bfloat16
    assert MediaItem("video", frames, (3, 4, 8), ((0, 24),), _spec((2, 2, 1))).grid_thw == (3, 4, 8)
    from vlbatch.operators.preprocess.shipped import patches_to_frames

    back, back_spec = patches_to_frames(normalize_patches(patches, spec.table), (2, 2, 4), 2, 2)  # the boundary form
    assert back_spec.layout == (4, 2, 2) and back.shape == (4, 8, 16, 3)  # 3 frames, the padded 4th repeats the 3rd
    assert torch.equal(MediaItem("video", back, (2, 2, 4), ((0, 4),), back_spec).model_input("cpu", torch.float32),
                       item.model_input("cpu", torch.float32))
    with pytest.raises(InputError, match="distinct values"):  # not a processor's values: no exact uint8 form
        patches_to_frames(torch.randn(128, 24), (1, 8, 16), 2, 2)
    # wrong t, wrong w, h not a multiple of merge, temporal 3 (t = 1), temporal 1 (t = 3, not 4)
    for grid, lay in (((1, 2, 4), (4, 2, 2)), ((2, 2, 2), (4, 2, 2)), ((2, 1, 4), (4, 2, 2)), ((2, 2, 4), (4, 2, 3)),
                      ((4, 4, 8), (2, 2, 1))):
        with pytest.raises(InputError, match="do not fill grid"):
            MediaItem("video", frames, grid, ((0, 4),), _spec(lay))


def test_media_item_hashes_its_frames_and_table():
    from vlbatch.operators.engine.loop import pinned_visual_tokens
    from vlbatch.operators.engine.media_spans import media_hash
    from vlbatch.operators.engine.request import Request

    u8 = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (1, 4, 8, 3), dtype=np.uint8))
    spec = _spec()
    item = MediaItem("image", u8, (1, 2, 4), ((0, 2),), spec)
    assert item.content_hash == media_hash("image", u8.numpy(), (1, 2, 4), spec.table.numpy(), spec.layout)
    assert MediaItem("image", u8, (1, 2, 4), ((0, 2),), _spec(do_normalize=False)).content_hash != item.content_hash
    assert media_hash("image", u8, (1, 2, 4)) != item.content_hash
    # requests sharing one media (one hash) pin its visual tokens once; another media adds its own
    pos = torch.zeros(3, 4, dtype=torch.long)
    reqs = [Request(f"q{k}", (1, 2, 3, 4), pos, media=(MediaItem("image", u8, (1, 2, 4), ((k % 2, k % 2 + 2),),
                                                                 spec, content_hash=item.content_hash),))
            for k in range(8)]
    assert pinned_visual_tokens(reqs) == 2
    assert pinned_visual_tokens(reqs + [Request("x", (1, 2, 3, 4), pos, media=(_item(0, ((0, 2),)),))]) == 4
