"""Scene clip boundaries (issue 60, items 4 and 5): no clip longer than `window_s`, ever; merging short
pieces never removes a cut between two shots of at least `min_clip_s`; the planner's held frames stay
bounded. Property-style over several cut patterns (`scene_clips` drives the streaming `ScenePlanner`)."""
from __future__ import annotations

import numpy as np
import pytest

from vlbatch.operators.media.clips import ClipRule, ScenePlanner, scene_clips

FPS = 10.0


def _patterns(rng):
    """(name, cuts, total) cut patterns: random, flashing, a false-cut storm after long shots, one long shot."""
    yield "one long shot", [], int(rng.integers(1, 400))
    yield "flashing", list(range(2, 300, 2)), 300
    yield "every 3 frames", list(range(3, 250, 3)), 251
    yield "storm after long shots", [50, 100, 150] + list(range(153, 200, 3)), 200  # the issue's video at 10 fps
    yield "short first and last", [4, 60, 117], 120
    for _ in range(40):
        total = int(rng.integers(1, 500))
        n = int(rng.integers(0, 30))
        gaps = rng.choice([1, 2, 3, 5, 8, 13, 40, 90], size=n)
        cuts = [int(c) for c in np.cumsum(gaps) if 0 < c < total]
        yield "random", cuts, total


def _shots(cuts, total):
    edges = [0] + sorted(set(cuts)) + [total]
    return list(zip(edges[:-1], edges[1:], strict=True))


@pytest.mark.parametrize(("window_s", "min_clip_s"), [(6.0, 1.0), (10.0, 1.0), (3.0, 1.5), (2.0, 0.0), (4.0, 9.0)])
def test_scene_clips_never_pass_window_and_keep_cuts_between_long_shots(window_s, min_clip_s):
    rule = ClipRule(mode="scenes", window_s=window_s, min_clip_s=min_clip_s)
    window, _, min_frames = rule.frames(FPS)
    min_frames = min(min_frames, window)
    rng = np.random.default_rng(int(window_s * 10 + min_clip_s))
    for name, cuts, total in _patterns(rng):
        clips = scene_clips(cuts, total, FPS, rule)
        bounds = [(c.start, c.end) for c in clips]
        assert [c.index for c in clips] == list(range(len(clips))), name
        assert bounds[0][0] == 0 and bounds[-1][1] == total, (name, bounds)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False)), (name, bounds)  # no gap
        assert all(0 < e - s <= window for s, e in bounds), (name, window, bounds)  # item 5
        if total >= min_frames:  # never a clip shorter than min_clip_s nor than half a window (evened out)
            assert all(e - s >= min(min_frames, window // 2) for s, e in bounds), (name, bounds)
        starts = {s for s, _ in bounds}
        shots = _shots(cuts, total)
        for (s0, e0), (s1, e1) in zip(shots, shots[1:], strict=False):
            if e0 - s0 >= min_frames and e1 - s1 >= min_frames:
                assert s1 in starts, (name, s1, bounds)  # item 4: merging never removes this cut


def test_issue_storm_keeps_the_cut_and_merges_the_storm():
    """The issue's video at 10 fps with its 128-pixel false cuts: long shots cut at 5, 10 and 15 s, then a
    false cut every 3 frames. The cut at 15 s stays; the storm is one segment split at window_s."""
    rule = ClipRule(mode="scenes", window_s=6.0, min_clip_s=1.0)
    clips = scene_clips([50, 100, 150] + list(range(153, 200, 3)), 200, FPS, rule)
    assert [(c.start, c.end) for c in clips] == [(0, 50), (50, 100), (100, 150), (150, 200)]


@pytest.mark.parametrize(("window_s", "min_clip_s"), [(6.0, 1.0), (2.0, 2.0), (5.0, 0.5)])
def test_planner_holds_a_few_windows_at_most(window_s, min_clip_s):
    """Fed frame by frame as the decode does, the planner never asks to keep more than the held clip,
    the open piece and the open cut's frames: 2 windows + 2 min_clip_s."""
    rule = ClipRule(mode="scenes", window_s=window_s, min_clip_s=min_clip_s)
    window, _, min_frames = rule.frames(FPS)
    rng = np.random.default_rng(7)
    for name, cuts, total in _patterns(rng):
        p, todo = ScenePlanner(rule, FPS), sorted(set(cuts))
        for i in range(total):
            while todo and todo[0] <= i:
                p.cut(todo.pop(0))
            p.advance(i)
            assert i + 1 - p.keep_from <= 2 * window + 2 * min(min_frames, window), (name, i, p.keep_from)
