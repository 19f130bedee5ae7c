"""MRoPE position ids vs transformers' `Qwen3_5Model.get_rope_index` and the seed's worked example."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from vlbatch.operators.errors import InputError
from vlbatch.operators.preprocess.rope import mrope_position_ids


def reference_rope(types, image_grid, video_grid, mask, merge=2):
    """Call the reference method unbound with a minimal `self` (its only state is the merge size)."""
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)))
    model.get_vision_position_ids = lambda *a, **k: Qwen3_5Model.get_vision_position_ids(model, *a, **k)
    t = lambda a: None if a is None else torch.as_tensor(np.asarray(a), dtype=torch.long)  # noqa: E731
    pos, deltas = Qwen3_5Model.get_rope_index(model, t(types), t(types), t(image_grid), t(video_grid), t(mask))
    return pos.numpy(), deltas.numpy().reshape(-1)


def test_seed_worked_example():
    """Seed 000 section 11.4: 2 text, image grid [1,4,6], 1 text -> T/H/W rows and rope_delta -3."""
    types = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 0]])
    pos, delta = mrope_position_ids(types, np.array([[1, 4, 6]]), None, None)
    assert pos[:, 0].tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5], [0, 1, 2, 2, 2, 3, 3, 3, 5],
                                  [0, 1, 2, 3, 4, 2, 3, 4, 5]]
    assert delta.tolist() == [-3]


def _random_row(rng, images, videos, merge=2):
    """A token-type row of text runs, images and videos (video = one run per temporal group, text between)."""
    row = [0] * int(rng.integers(1, 6))
    for _ in range(int(rng.integers(0, 4))):
        if rng.random() < 0.5:
            g = [1, int(rng.integers(1, 6)) * merge, int(rng.integers(1, 6)) * merge]
            images.append(g)
            row += [1] * (g[0] * g[1] * g[2] // merge ** 2)
        else:
            g = [int(rng.integers(1, 5)), int(rng.integers(1, 5)) * merge, int(rng.integers(1, 5)) * merge]
            videos.append(g)
            for _ in range(g[0]):
                row += [0] * int(rng.integers(1, 4)) + [2] * (g[1] * g[2] // merge ** 2) + [0]
        row += [0] * int(rng.integers(1, 4))  # vision_end and text: media never touch
    return row


@pytest.mark.parametrize("side", ["right", "left", None])
def test_random_batches_match_reference(side):
    rng = np.random.default_rng({"right": 0, "left": 1, None: 2}[side])
    for _ in range(40):
        b = 1 if side is None else int(rng.integers(1, 4))
        images, videos = [], []
        rows = [_random_row(rng, images, videos) for _ in range(b)]
        length = max(map(len, rows))
        types = np.zeros((b, length), np.int64)
        mask = np.zeros((b, length), np.int64)
        for i, r in enumerate(rows):
            sl = slice(length - len(r), length) if side == "left" else slice(0, len(r))
            types[i, sl], mask[i, sl] = r, 1
        ig = np.array(images).reshape(-1, 3) if images else None
        vg = np.array(videos).reshape(-1, 3) if videos else None
        m = None if side is None else mask
        pos, deltas = mrope_position_ids(types, ig, vg, m)
        ref_pos, ref_deltas = reference_rope(types, ig, vg, m)
        assert pos.dtype == np.int64 and pos.shape == (3, b, length)
        np.testing.assert_array_equal(pos, ref_pos)
        np.testing.assert_array_equal(deltas, ref_deltas)


def test_mismatched_runs_raise_input_error():
    with pytest.raises(InputError, match="does not match its grid"):
        mrope_position_ids(np.array([[0, 1, 1, 1, 0]]), np.array([[1, 4, 4]]))
    with pytest.raises(InputError, match="more image token runs"):
        mrope_position_ids(np.array([[0, 1, 0, 1]]), np.array([[1, 2, 2]]))
