"""Scene clips (issue 60, items 4 and 5): our cuts on a real encoded video whose last scene is scrolling
stripes equal PySceneDetect's on the full-size frames; no clip longer than `window_s`, ever; merging short
pieces never removes a cut between two shots of at least `min_clip_s`; the planner's held frames stay
bounded. Property-style over several cut patterns (`scene_clips` drives the streaming `ScenePlanner`)."""
from __future__ import annotations

import numpy as np
import pytest

from vlbatch.devtools.samples import encode_video
from vlbatch.operators.media.clip_decode import decode_clips
from vlbatch.operators.media.clips import ClipRule, ScenePlanner, scene_clips
from vlbatch.operators.media.video import FrameSampling

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


COLOURS = ((220, 30, 30), (30, 200, 40), (20, 20, 120))


def _stripes_after_cuts(period: int, speed: int):
    """The issue's video: scenes cut at 5, 10 and 15 s (a colour and a moving square each), the last one
    vertical stripes `period` px wide scrolling `speed` px a frame."""
    def pattern(i: int, width: int, height: int) -> np.ndarray:
        k = int(i // (5 * FPS))
        img = np.empty((height, width, 3), np.uint8)
        if k < 3:
            img[:] = COLOURS[k]
            s, x = height // 8, (i * 4) % (width - height // 8)
            img[height // 3: height // 3 + s, x: x + s] = 255 - np.asarray(COLOURS[k], np.uint8)
        else:
            on = (np.arange(width) + i * speed) // period % 2 == 1
            img[:] = np.where(on, np.uint8(230), np.uint8(25))[None, :, None]
        return img
    return pattern


def _cuts(data: bytes, full_size: bool) -> list[int]:
    """PySceneDetect's ContentDetector (defaults) on every frame: full size (the reference, straight from
    the library) or ours (`CutDetector` on `small_bgr`'s pictures, as the scene decode feeds it)."""
    import io

    import av
    from av.video.reformatter import VideoReformatter
    from scenedetect import ContentDetector
    from scenedetect.common import FrameTimecode

    from vlbatch.operators.media.clip_decode import small_bgr
    from vlbatch.operators.media.clips import CutDetector

    ref, ours, small, cuts = ContentDetector(min_scene_len=1), CutDetector(ClipRule(), FPS), VideoReformatter(), []
    with av.open(io.BytesIO(data)) as c:
        for i, f in enumerate(c.decode(video=0)):
            if full_size:
                found = ref.process_frame(FrameTimecode(i, FPS), f.to_ndarray(format="bgr24"))
                cuts += [int(t.frame_num) for t in found]
            else:
                cuts += ours.feed(i, small_bgr(f, small))
    if full_size:
        return cuts + [int(t.frame_num) for t in ref.post_process(FrameTimecode(i, FPS))]
    return cuts + ours.finish(i)


@pytest.mark.slow
@pytest.mark.parametrize(("period", "speed"), [(10, 3), (10, 1), (16, 5)])
def test_cuts_match_full_size_detection_when_the_last_scene_is_scrolling_stripes(tmp_path, period, speed):
    """Issue 60 item 4: 640x360, 20 s; every-5th-sample frames made the stripes alias into false cuts (and the
    merge folded the cut at 15 s away). Our clips start exactly at the full-size detector's cuts."""
    path = tmp_path / "stripes.mp4"
    encode_video(path, int(20 * FPS), 640, 360, FPS, pattern=_stripes_after_cuts(period, speed))
    data = path.read_bytes()
    reference = _cuts(data, full_size=True)
    assert reference == [50, 100, 150]  # the reference finds the three cuts and nothing else
    assert _cuts(data, full_size=False) == reference
    out = list(decode_clips(data, ClipRule(mode="scenes", window_s=10.0, min_clip_s=1.0), FrameSampling(fps=1.0)))
    assert [(c.start, c.end) for c, _ in out] == [(0, 50), (50, 100), (100, 150), (150, 200)]
