"""The compiled frames -> patches pass (`model/ops/pixels_cpu.py`) against its torch twin
(`pixels.normalize_frames_torch`) bit for bit, over odd shapes: frame counts that fill, pad
and repeat temporal groups, one and three channels, patch sizes 14 and 16, temporal 1 and 2,
merge 1 and 2; and `normalize_frames` takes the compiled pass exactly where it applies."""
from __future__ import annotations

import pytest
import torch

from vlbatch.operators.model import pixels
from vlbatch.operators.model.ops import pixels_cpu


@pytest.mark.parametrize("frames,patch,merge,temporal", [
    (1, 16, 2, 2), (2, 16, 2, 2), (3, 14, 2, 2), (16, 16, 2, 2), (5, 14, 1, 1), (4, 16, 2, 3), (1, 14, 1, 2),
])
@pytest.mark.parametrize("channels", [3, 1])
def test_compiled_pass_equals_the_torch_twin(frames, patch, merge, temporal, channels):
    gen = torch.Generator().manual_seed(frames * patch + channels)
    side = patch * merge
    x = torch.randint(0, 256, (frames, 3 * side, 2 * side, channels), dtype=torch.uint8, generator=gen)
    table = torch.randn(channels, 256, generator=gen)
    layout = dict(patch=patch, merge=merge, temporal=temporal)
    got = pixels_cpu.normalize_frames_cpu(x, table, **layout)
    want = pixels.normalize_frames_torch(x, table, **layout)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_normalize_frames_takes_the_compiled_pass_only_where_it_applies(monkeypatch):
    calls = []
    monkeypatch.setattr(pixels_cpu, "normalize_frames_cpu",
                        lambda *a, **k: calls.append(1) or pixels.normalize_frames_torch(*a, **k))
    layout = dict(patch=2, merge=2, temporal=2)
    x = torch.randint(0, 256, (3, 8, 4, 3), dtype=torch.uint8)
    table = torch.randn(3, 256)
    want = pixels.normalize_frames_torch(x, table, **layout)
    assert torch.equal(pixels.normalize_frames(x, table, **layout), want) and calls == [1]
    strided = torch.randint(0, 256, (3, 8, 8, 3), dtype=torch.uint8)[:, :, :4]
    for frames, tab in ((x, table.double()), (strided, table)):  # a float64 table, strided frames: the twin
        out = pixels.normalize_frames(frames, tab, **layout)
        assert torch.equal(out, pixels.normalize_frames_torch(frames, tab, **layout))
    assert calls == [1]
