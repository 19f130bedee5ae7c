"""smart_resize (image and video, with and without the per-frame cap) and the resize op vs transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as ref_image_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as ref_video_resize

from vlbatch.operators.errors import InputError
from vlbatch.operators.preprocess.resize import (
    resize_frames,
    smart_resize_image,
    smart_resize_video,
    video_max_pixels,
)


def _dims(rng, n):
    """Heights/widths over many aspect ratios up to 200:1, tiny and huge."""
    for _ in range(n):
        short = int(rng.choice([1, 2, 3, 7, 15, 16, 31, 33, 64, 99, 480, 1080, 2161]))
        ratio = float(rng.choice([1, 1.33, 1.78, 2.5, 7, 33.3, 100, 199.9, 200]))
        long = max(short, int(short * ratio))
        if long / short > 200:
            long = short * 200
        yield (short, long) if rng.random() < 0.5 else (long, short)


def test_image_sizes_match_reference():
    rng = np.random.default_rng(0)
    budgets = [(65536, 16777216), (56 * 56, 28 * 28 * 1280), (4096, 200_000)]
    for h, w in _dims(rng, 400):
        for lo, hi in budgets:
            assert smart_resize_image(h, w, factor=32, min_pixels=lo, max_pixels=hi) == \
                ref_image_resize(h, w, factor=32, min_pixels=lo, max_pixels=hi), (h, w, lo, hi)


def test_video_sizes_match_reference():
    rng = np.random.default_rng(1)
    for h, w in _dims(rng, 300):
        f = int(rng.integers(2, 70))
        for lo, hi in [(4096, 25165824), (4096, 300_000), (128 * 32 * 32, 32 * 32 * 768)]:
            try:
                ref = ref_video_resize(f, h, w, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)
            except ValueError:
                with pytest.raises(InputError):
                    smart_resize_video(f, h, w, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)
                continue
            assert smart_resize_video(f, h, w, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi) == ref


@pytest.mark.parametrize("cap", [False, True])
def test_video_patch_counts_match_reference_with_and_without_cap(cap):
    vp = Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824}, cap_pixels_per_frame=cap)
    rng = np.random.default_rng(2)
    for h, w in _dims(rng, 150):
        f = int(rng.integers(2, 200))
        if max(h, w) / min(h, w) > 200 or min(h, w) < 4:
            continue
        budget = video_max_pixels(f, factor=32, min_pixels=4096, max_pixels=25165824, cap_pixels_per_frame=cap)
        rh, rw = smart_resize_video(f, h, w, factor=32, min_pixels=4096, max_pixels=budget)
        ours = -(-f // 2) * (rh // 16) * (rw // 16)
        assert ours == vp.get_num_of_video_patches(f, h, w), (f, h, w, cap)


def test_cap_limits_short_clips():
    """With the cap a 4-frame clip gets at most 768 merged tokens per frame; without it far more."""
    cap = video_max_pixels(4, factor=32, min_pixels=4096, max_pixels=25165824, cap_pixels_per_frame=True)
    assert cap == 4 * 768 * 32 * 32
    h, w = smart_resize_video(4, 2160, 3840, factor=32, min_pixels=4096, max_pixels=cap)
    assert h * w <= 768 * 32 * 32
    h2, w2 = smart_resize_video(4, 2160, 3840, factor=32, min_pixels=4096, max_pixels=25165824)
    assert h2 * w2 > 4 * h * w


def test_limits_raise_input_error():
    with pytest.raises(InputError, match="aspect ratio"):
        smart_resize_image(1, 201)
    with pytest.raises(InputError, match="aspect ratio"):
        smart_resize_video(4, 3000, 10)
    with pytest.raises(InputError, match="at least 2 sampled frames"):
        smart_resize_video(1, 64, 64)
    with pytest.raises(InputError, match="positive"):
        smart_resize_image(0, 10)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("shape, size", [((1, 3, 37, 53), (64, 64)), ((1, 3, 480, 640), (480, 640)),
                                          ((3, 3, 90, 161), (96, 160)), ((1, 3, 1080, 1920), (544, 960)),
                                          ((1, 3, 1, 7), (32, 224)), ((2, 3, 5, 1), (320, 64))])
def test_resize_op_is_the_reference_op(shape, size, layout):
    """Our resize (either layout) vs the reference image processor's own `resize` on channels-first uint8."""
    x = torch.from_numpy(np.random.default_rng(3).integers(0, 256, shape, dtype=np.uint8))
    ref = Qwen2VLImageProcessor(patch_size=16, merge_size=2)
    expect = super(Qwen2VLImageProcessor, ref).resize(image=x, size=SizeDict(height=size[0], width=size[1]),
                                                      resample=3)
    ours_in = x if layout == "channels_first" else x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    got = resize_frames(ours_in, *size)
    assert got.dtype == torch.uint8 and got.shape[-2:] == size
    assert torch.equal(got, expect)
