"""Engine data structures without a model: blocks, state pool, prefix tree, planning, vision cache."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vlbatch.operators.engine.block_manager import BlockManager, blocks_for_budget, kv_bytes_per_block
from vlbatch.operators.engine.branch_points import plan_branch_points, plan_branch_points_naive
from vlbatch.operators.engine.prefix_cache import KeyCodec, RadixPrefixCache
from vlbatch.operators.engine.request import MediaItem
from vlbatch.operators.engine.state_pool import StatePool
from vlbatch.operators.engine.vision_cache import LRUVisionCache
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


# -- prefix cache ----------------------------------------------------------------------------
def _snap(value: float):
    from vlbatch.operators.engine.state_pool import Snapshot

    return Snapshot(torch.full((2, 3, 4), value), torch.full((2, 1, 2, 2), value))


def _computed(bm, n):
    table: list[int] = []
    bm.grow_table(table, n)
    return table


def test_match_at_exact_non_aligned_positions_and_shares_full_blocks():
    bm = BlockManager(32, 4)
    pc = RadixPrefixCache(bm, block_bytes=100, budget_bytes=10**9)
    keys = np.arange(100, 111)  # 11 tokens
    table = _computed(bm, 11)
    pc.insert(keys[:7], table, _snap(7.0))  # branch point at 7 (not a multiple of 4)
    pc.insert(keys, table, _snap(11.0))
    q = np.concatenate([keys[:9], [1, 2, 3]])
    m = pc.match(q, max_len=len(q) - 1)
    assert m.length == 7 and m.key_len == 9 and m.snapshot.conv.eq(7).all()
    assert m.blocks == tuple(table[:2])  # positions 0..6: block 0 full, block 1 partial tail
    m2 = pc.match(np.concatenate([keys, [5]]), max_len=11)
    assert m2.length == 11 and m2.blocks == tuple(table[:3])
    assert pc.match(keys, max_len=10).length == 7  # a hit must leave a token to compute
    assert pc.match(np.array([999, 1]), 1).length == 0
    bm.decref(table)  # the sequence finishes; the tree keeps its blocks
    # block 1 straddles the branch point: held by both nodes of the path
    assert [bm.refcount(b) for b in table] == [1, 2, 1]


def test_split_keeps_straddling_block_for_both_halves():
    bm = BlockManager(32, 4)
    pc = RadixPrefixCache(bm, block_bytes=100, budget_bytes=10**9)
    a = np.arange(10)
    ta = _computed(bm, 10)
    pc.insert(a, ta, _snap(1.0))
    b = np.concatenate([a[:6], [50, 51, 52, 53]])
    tb = list(ta[:1]) + _computed(bm, 8)[:2]  # b computed its own block 1 (copy) and block 2
    pc.insert(b[:6], tb, _snap(2.0))  # split a's node at 6 (mid block 1)
    assert bm.refcount(ta[1]) == 3  # a's sequence + both halves of the split node
    pc.insert(b, tb, _snap(3.0))
    mb = pc.match(np.concatenate([b, [0]]), 10)
    ma = pc.match(np.concatenate([a, [0]]), 10)
    assert mb.blocks == (ta[0], tb[1], tb[2]) and ma.blocks == tuple(ta[:3])
    assert pc.match(np.concatenate([a[:6], [77]]), 6).snapshot.conv.eq(2).all()


def test_eviction_lru_under_budget_never_touches_locked():
    bm = BlockManager(64, 4)
    snap_bytes = _snap(0).nbytes
    pc = RadixPrefixCache(bm, block_bytes=10, budget_bytes=3 * snap_bytes + 100)
    nodes = []
    for i in range(3):
        t = _computed(bm, 4)
        nodes.append(pc.insert(np.array([i, 1, 2, 3]), t, _snap(i)))
        bm.decref(t)
    m0 = pc.match(np.array([0, 1, 2, 3, 9]), 4)
    pc.lock(m0.node)
    pc.match(np.array([2, 1, 2, 3, 9]), 4)  # refresh 2: 1 is now least recently used
    t = _computed(bm, 4)
    pc.insert(np.array([3, 1, 2, 3]), t, _snap(3))  # over budget: one leaf must go
    bm.decref(t)
    assert pc.nbytes <= pc.budget_bytes
    assert pc.match(np.array([1, 1, 2, 3, 9]), 4).length == 0  # LRU victim
    assert pc.match(np.array([0, 1, 2, 3, 9]), 4).length == 4  # locked survives
    free_before = bm.num_free
    assert pc.evict_blocks(bm.num_blocks) is False  # cannot free the locked node's block
    assert bm.num_free == free_before + 2 and pc.match(np.array([0, 1, 2, 3, 9]), 4).length == 4
    pc.unlock(m0.node)
    pc.clear()
    assert bm.num_free == bm.num_blocks and pc.nbytes == 0


def test_eviction_takes_expected_prefixes_last_and_still_frees_blocks():
    from vlbatch.operators.engine.branch_points import prefix_digest

    bm = BlockManager(64, 4)
    pc = RadixPrefixCache(bm, block_bytes=10, budget_bytes=2 * _snap(0).nbytes + 100)
    keys = [np.array([i, 1, 2, 3, 4, 5]) for i in range(3)]
    for i in range(2):
        t = _computed(bm, 6)
        pc.insert(keys[i][:5], t, _snap(i))  # prefix 0 is the least recently used
        bm.decref(t)
    pc.expect([prefix_digest(keys[0], 5)])  # a queued request plans to reuse prefix 0
    t = _computed(bm, 6)
    pc.insert(keys[2][:5], t, _snap(2))  # over budget: the unexpected prefix 1 goes, not the LRU one
    bm.decref(t)
    assert pc.match(keys[0], 5).length == 5 and pc.match(keys[1], 5).length == 0
    pc.unexpect([prefix_digest(keys[0], 5)])
    pc.match(keys[0], 5)  # prefix 0 is now the most recently used: plain LRU takes prefix 2
    pc.budget_bytes = _snap(0).nbytes + 100
    pc.evict_to_budget()
    assert pc.match(keys[0], 5).length == 5 and pc.match(keys[2], 5).length == 0
    pc.expect([prefix_digest(keys[0], 5)])
    assert pc.evict_blocks(bm.num_blocks) is True and pc.nbytes == 0  # KV memory still comes first


def test_snapshot_points_are_spaced_by_a_block_keeping_the_earlier():
    from vlbatch.operators.engine.prefix_cache import spaced

    # a 13-token header, the media end at 461, all siblings branch at 463, pairs at 465 / 466
    assert spaced({13, 461, 463, 465, 466}, 486, 16) == (461,)
    assert spaced({40, 60, 100}, 120, 16) == (40, 60, 100)  # far enough apart: all kept
    assert spaced({16, 31, 32, 47, 48}, 120, 16) == (16, 32, 48)  # measured from the last kept one
    assert spaced({20, 40}, 40, 16) == (20,)  # never at the prompt's end
    assert spaced(set(), 10, 16) == ()


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
