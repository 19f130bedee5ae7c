"""Frame sampling and group timestamps vs transformers' Qwen3VL video processor / processor."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from vlbatch.operators.errors import InputError
from vlbatch.operators.preprocess import group_timestamps, sample_frame_indices


def _reference_indices(total, src_fps, *, fps=None, num_frames=None, min_frames=4, max_frames=768):
    vp = Qwen3VLVideoProcessor(min_frames=min_frames, max_frames=max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=src_fps)
    return np.asarray(vp.sample_frames(meta, num_frames=num_frames, fps=fps))


def _cases(n=300, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        total = int(rng.choice([1, 2, 3, 5, 7, 8, 16, 31, 100, 301, 1000, 24 * 600 + 7]))
        src = float(rng.choice([23.976, 24.0, 25.0, 29.97, 30.0, 50.0, 59.94, 1.0, 0.5, 120.0]))
        lo = int(rng.integers(1, 9))
        hi = int(rng.integers(lo, 800))
        if rng.random() < 0.5:
            yield total, src, dict(fps=float(rng.choice([0.5, 1, 2, 2.5, 4, 30])), min_frames=lo, max_frames=hi)
        else:
            yield total, src, dict(num_frames=int(rng.integers(1, 40)), min_frames=lo, max_frames=hi)
    yield 100, None, dict(fps=2.0)  # no container frame rate: both fall back to 24
    yield 100, 30.0, dict()  # neither given: the default 2 fps


def test_indices_match_reference():
    checked = 0
    for total, src, kw in _cases():
        ours = sample_frame_indices(total, src, **kw)
        ref = _reference_indices(total, src, **kw)
        assert ours.dtype == np.int64
        np.testing.assert_array_equal(ours, ref, err_msg=f"{total=} {src=} {kw=}")
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_group_timestamps_match_reference(tp):
    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # only the pure timestamp helper is used
    rng = np.random.default_rng(tp)
    for _ in range(100):
        total = int(rng.integers(1, 2000))
        src = float(rng.choice([23.976, 25.0, 29.97, 60.0, 7.5]))
        idx = sample_frame_indices(total, src, num_frames=int(rng.integers(1, 33)))
        ours = group_timestamps(idx, src, temporal_patch_size=tp)
        ref = proc._calculate_timestamps(idx.copy(), src, tp)
        assert ours == ref  # exact floats: the same arithmetic
        assert [f"<{t:.1f} seconds>" for t in ours] == [f"<{t:.1f} seconds>" for t in ref]
        assert len(ours) == -(-len(idx) // tp)


def test_odd_count_pads_last_frame():
    # 3 frames at 10 fps: groups (0, 5) and (9, 9 repeated)
    assert group_timestamps([0, 5, 9], 10.0) == [0.25, 0.9]


@pytest.mark.parametrize(
    "args, kw, words",
    [
        ((100, 30.0), dict(fps=2.0, num_frames=8), "mutually exclusive"),
        ((100, 30.0), dict(fps=0.0), "fps"),
        ((100, 30.0), dict(fps=-1.0), "fps"),
        ((100, 0.0), dict(fps=2.0), "frame rate"),
        ((100, float("nan")), dict(), "frame rate"),
        ((0, 30.0), dict(), "no decodable frames"),
        ((-3, 30.0), dict(num_frames=4), "no decodable frames"),
        ((100, 30.0), dict(num_frames=0), "num_frames"),
    ],
)
def test_bad_sampling_requests_raise_input_error(args, kw, words):
    with pytest.raises(InputError, match=words):
        sample_frame_indices(*args, **kw)


def test_bad_timestamp_requests_raise_input_error():
    with pytest.raises(InputError):
        group_timestamps([0, 1], 0.0)
    with pytest.raises(InputError):
        group_timestamps([], 30.0)
