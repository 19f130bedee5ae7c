"""Compiled block-major patchify vs the naive float-first reference over odd shapes, plus the seed's patch order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbatch.operators.preprocess.patchify import Normalization, patchify_into, patchify_naive

NORMS = {
    "qwen": Normalization(),
    "per_channel": Normalization(image_mean=(0.48145466, 0.4578275, 0.40821073),
                                 image_std=(0.26862954, 0.26130258, 0.27577711)),
    "rescale_only": Normalization(do_normalize=False),
    "raw": Normalization(do_normalize=False, do_rescale=False),
}


def _fast(frames_fhwc: np.ndarray, norm, patch, merge, temporal):
    f, h, w, c = frames_fhwc.shape
    n = -(-f // temporal) * (h // patch) * (w // patch)
    out = np.full((n, c * temporal * patch * patch), np.nan, np.float32)
    grid = patchify_into(out, frames_fhwc, norm.lut(c), patch=patch, merge=merge, temporal=temporal)
    return out, grid


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize(
    "frames, bh, bw, patch, merge, temporal",
    [
        (1, 1, 1, 16, 2, 2),  # smallest image
        (1, 3, 5, 16, 2, 2),  # odd block counts
        (1, 7, 2, 4, 3, 2),  # merge 3
        (1, 2, 3, 5, 2, 3),  # odd patch, temporal 3
        (2, 1, 3, 16, 2, 2),
        (3, 2, 1, 16, 2, 2),  # odd frame count: last frame repeated
        (5, 3, 3, 8, 2, 2),
        (4, 1, 2, 4, 1, 3),  # 4 frames, temporal 3 -> pad 2
        (1, 2, 2, 3, 2, 1),  # temporal 1
    ],
)
def test_fast_matches_naive_bitwise(norm, frames, bh, bw, patch, merge, temporal):
    rng = np.random.default_rng(frames * 100 + bh * 10 + bw)
    h, w = bh * merge * patch, bw * merge * patch
    x = rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
    fast, grid = _fast(x, NORMS[norm], patch, merge, temporal)
    naive = patchify_naive(torch.from_numpy(x).permute(0, 3, 1, 2), NORMS[norm], patch=patch, merge=merge,
                           temporal=temporal).numpy()
    assert grid == (-(-frames // temporal), h // patch, w // patch)
    assert fast.shape == naive.shape
    np.testing.assert_array_equal(fast, naive)  # bit-identical, and no NaN left unwritten


def test_non_contiguous_input_is_accepted():
    x = np.random.default_rng(0).integers(0, 256, (2, 64, 96, 3), dtype=np.uint8)
    strided = np.asarray(torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).permute(0, 2, 3, 1))
    assert not strided.flags.c_contiguous
    a, _ = _fast(x, NORMS["qwen"], 16, 2, 2)
    b, _ = _fast(strided, NORMS["qwen"], 16, 2, 2)
    np.testing.assert_array_equal(a, b)


def test_seed_block_major_order():
    """Seed 000 section 4.4: a 4x4 patch grid with merge 2 is ordered 0 1 4 5 2 3 6 7 8 9 12 13 10 11 14 15."""
    p = 2
    idx = np.arange(16).reshape(4, 4)
    img = np.kron(idx, np.ones((p, p), dtype=np.int64)).astype(np.uint8)  # each patch constant = its index
    frames = np.stack([img, img + 100, img + 200], axis=-1)[None]  # [1, 8, 8, 3]
    out, _ = _fast(frames, NORMS["raw"], p, 2, 2)
    rows = out.reshape(16, 3, 2, p, p)
    assert rows[:, 0, 0, 0, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert (rows[:, 1] == rows[:, 0] + 100).all() and (rows[:, 2] == rows[:, 0] + 200).all()


def test_video_tubelets_pair_frames_and_image_repeats():
    """Row layout [C, tp, p, p]: a video row holds frames 2g and 2g+1; an image row the same pixels twice."""
    p = 2
    frames = np.zeros((3, 4, 4, 3), np.uint8)
    for f in range(3):
        frames[f] = 10 * (f + 1)
    out, grid = _fast(frames, NORMS["raw"], p, 2, 2)
    rows = out.reshape(-1, 3, 2, p, p)
    assert grid == (2, 2, 2)
    assert (rows[:4, :, 0] == 10).all() and (rows[:4, :, 1] == 20).all()
    assert (rows[4:, :, 0] == 30).all() and (rows[4:, :, 1] == 30).all()  # odd count: last frame repeated
    img, _ = _fast(frames[:1], NORMS["raw"], p, 2, 2)
    assert (img == 10).all()


def test_qwen_normalisation_values():
    """x/255 with mean = std = 0.5 is x/127.5 - 1 (seed 000 section 4.1)."""
    lut = Normalization().lut(3)
    np.testing.assert_allclose(lut, np.tile(np.arange(256) / 127.5 - 1, (3, 1)), rtol=0, atol=1e-6)
    assert lut.dtype == np.float32 and lut.min() == -1 and lut.max() == 1


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of patch"):
        _fast(np.zeros((1, 30, 32, 3), np.uint8), NORMS["qwen"], 16, 2, 2)
    with pytest.raises(ValueError, match="expected"):
        patchify_into(np.zeros((3, 1536), np.float32), np.zeros((1, 32, 32, 3), np.uint8), NORMS["qwen"].lut(),
                      patch=16, merge=2, temporal=2)


# -- uint8 mode and the model-side normalisation ----------------------------------------------
SHAPES = [(1, 1, 1, 16, 2, 2), (1, 3, 5, 16, 2, 2), (1, 7, 2, 4, 3, 2), (1, 2, 3, 5, 2, 3), (3, 2, 1, 16, 2, 2),
          (4, 1, 2, 4, 1, 3), (1, 2, 2, 3, 2, 1)]


@pytest.mark.parametrize("frames, bh, bw, patch, merge, temporal", SHAPES)
def test_uint8_mode_is_the_naive_layout_of_the_levels(frames, bh, bw, patch, merge, temporal):
    rng = np.random.default_rng(frames * 100 + bh * 10 + bw + 7)
    h, w = bh * merge * patch, bw * merge * patch
    x = rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
    n = -(-frames // temporal) * (h // patch) * (w // patch)
    out = np.zeros((n, 3 * temporal * patch * patch), np.uint8)
    grid = patchify_into(out, x, None, patch=patch, merge=merge, temporal=temporal)
    naive = patchify_naive(torch.from_numpy(x).permute(0, 3, 1, 2), NORMS["raw"], patch=patch, merge=merge,
                           temporal=temporal).numpy()
    assert grid == (-(-frames // temporal), h // patch, w // patch)
    np.testing.assert_array_equal(out, naive.astype(np.uint8))
    assert np.array_equal(out.astype(np.float32), naive)  # every level exact (no clipping, no rounding)


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("frames, bh, bw, patch, merge, temporal", SHAPES)
def test_normalising_uint8_levels_equals_the_float32_path_bitwise(norm, frames, bh, bw, patch, merge, temporal):
    """Both model-side forms equal the processor's float32 patches bit for bit: uint8 patches
    through the table (and its numpy twin), and the pipeline's uint8 frames (layout, then the
    lookup, on the model's device); the layout alone equals the numpy uint8 patch mode."""
    from vlbatch.operators.model.pixels import (
        frames_to_patches,
        normalize_frames,
        normalize_patches,
        normalize_patches_naive,
    )

    rng = np.random.default_rng(frames * 31 + bh * 7 + bw)
    h, w = bh * merge * patch, bw * merge * patch
    x = rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
    f32, _ = _fast(x, NORMS[norm], patch, merge, temporal)
    u8 = np.zeros(f32.shape, np.uint8)
    patchify_into(u8, x, None, patch=patch, merge=merge, temporal=temporal)
    lut = NORMS[norm].lut(3)
    layout = dict(patch=patch, merge=merge, temporal=temporal)
    np.testing.assert_array_equal(frames_to_patches(torch.from_numpy(x), **layout).numpy(), u8)
    from_frames = normalize_frames(torch.from_numpy(x), torch.from_numpy(lut), **layout)
    assert from_frames.is_contiguous()
    for got in (normalize_patches(torch.from_numpy(u8), torch.from_numpy(lut)).numpy(),
                normalize_patches_naive(u8, lut), from_frames.numpy()):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), f32.view(np.uint32))  # bit for bit


def test_normalize_frames_rejects_bad_inputs():
    from vlbatch.operators.errors import InputError
    from vlbatch.operators.model.pixels import normalize_frames

    table = torch.zeros(3, 256)
    with pytest.raises(InputError, match="multiple"):
        normalize_frames(torch.zeros(1, 40, 32, 3, dtype=torch.uint8), table, patch=16, merge=2, temporal=2)
    with pytest.raises(InputError, match="uint8"):
        normalize_frames(torch.zeros(1, 32, 32, 3), table, patch=16, merge=2, temporal=2)
    with pytest.raises(InputError, match="uint8"):
        normalize_frames(torch.zeros(1, 32, 32, 4, dtype=torch.uint8), table, patch=16, merge=2, temporal=2)


def test_normalising_in_the_model_dtype_is_the_float32_values_cast():
    from vlbatch.operators.model.pixels import normalize_patches

    u8 = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (37, 5 * 12), dtype=np.uint8))
    table = torch.from_numpy(np.random.default_rng(4).standard_normal((5, 256)).astype(np.float32))  # C = 5
    f32 = normalize_patches(u8, table)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(normalize_patches(u8, table.to(dtype)), f32.to(dtype))
    assert torch.equal(f32[:, 12:24], table[1][u8[:, 12:24].long()])  # column block 1 is channel 1


def test_uint8_mode_rejects_mismatched_outputs():
    from vlbatch.operators.errors import InputError
    from vlbatch.operators.model.pixels import normalize_patches

    with pytest.raises(ValueError, match="uint8"):  # a float buffer without a table
        patchify_into(np.zeros((4, 1536), np.float32), np.zeros((1, 32, 32, 3), np.uint8), None,
                      patch=16, merge=2, temporal=2)
    with pytest.raises(InputError):
        normalize_patches(torch.zeros(4, 10, dtype=torch.uint8), torch.zeros(3, 256))  # 3 does not divide 10
    with pytest.raises(InputError):
        normalize_patches(torch.zeros(4, 12), torch.zeros(3, 256))  # float input
