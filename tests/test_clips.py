"""Video clips (issue 51): `video.clips` config refusals, fixed windows and scene cuts on real
encoded video made here (hard cuts at known frames), the per-clip sampling and its timestamps."""
from __future__ import annotations

import numpy as np
import pytest

from vlbatch.devtools.samples import encode_video
from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.clip_decode import clip_indices, decode_clips
from vlbatch.operators.media.clips import ClipRule, fixed_clips, scene_clips
from vlbatch.operators.media.video import FrameSampling
from vlbatch.pipeline.config import validate_config

MIN = {"model": {"path": "m"}, "input": {"uri": "in.parquet"}, "output": {"uri": "out"}}
FPS = 10
CUTS = (23, 57, 71)  # first frame of each new scene
COLOURS = ((220, 30, 30), (30, 200, 40), (20, 20, 120), (240, 230, 60))


def scenes_pattern(i: int, width: int, height: int) -> np.ndarray:
    """Scene k (between CUTS): its own background colour and a moving square of its own shade."""
    k = sum(i >= c for c in CUTS)
    img = np.empty((height, width, 3), np.uint8)
    img[:] = COLOURS[k]
    x = (i * 3) % (width - 16)
    img[height // 3: height // 3 + 16, x: x + 16] = 255 - np.asarray(COLOURS[k], np.uint8)
    return img


def _video(tmp_path, n: int, name: str = "scenes.mp4", width: int = 128, height: int = 96, **kw) -> bytes:
    path = tmp_path / name
    encode_video(path, n, width, height, FPS, options={"g": "12", "bf": "2"}, pattern=scenes_pattern, **kw)
    return path.read_bytes()


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(("clips", "field"), [
    ({"mode": "fixed", "window_s": 0}, "video.clips.window_s"),
    ({"mode": "fixed", "window_s": -2}, "video.clips.window_s"),
    ({"mode": "fixed", "window_s": 2, "stride_s": 5}, "stride_s"),
    ({"mode": "scenes", "detector": "transnet"}, "video.clips.detector"),
    ({"mode": "shots"}, "video.clips.mode"),
])
def test_validate_refuses_bad_clip_fields_by_name(clips, field):
    with pytest.raises(ConfigError) as e:
        validate_config({**MIN, "video": {"clips": clips}})
    assert field in str(e.value)


def test_validate_refuses_clips_where_they_cannot_run_yet():
    with pytest.raises(ConfigError, match="decode_device: cpu"):
        validate_config({**MIN, "video": {"decode_device": "model-cpu", "clips": {"mode": "fixed"}}})
    assert validate_config({**MIN, "task": {"mode": "scan"}, "video": {"clips": {"mode": "fixed"}}})  # scan counts clips


def test_clip_config_defaults_and_gaps_when_asked():
    cfg = validate_config(MIN)
    assert cfg.video.clips.mode == "none"
    cfg = validate_config({**MIN, "video": {"clips": {"mode": "fixed", "window_s": 2, "stride_s": 5,
                                                      "allow_gaps": True}}})
    rule = cfg.video.clips.rule()
    assert rule == ClipRule(mode="fixed", window_s=2.0, stride_s=5.0, min_clip_s=1.0, allow_gaps=True)


# ---------------------------------------------------------------- boundaries (counts)


def test_fixed_windows_exact_count_and_times():
    rule = ClipRule(mode="fixed", window_s=2.0, min_clip_s=0.5)
    clips = fixed_clips(95, FPS, rule)  # 9.5 s: 2,2,2,2 and a last 1.5 s window (kept: >= 0.5 s)
    assert [(c.start_s, c.end_s) for c in clips] == [(0.0, 2.0), (2.0, 4.0), (4.0, 6.0), (6.0, 8.0), (8.0, 9.5)]
    assert [c.index for c in clips] == [0, 1, 2, 3, 4] and {c.source for c in clips} == {"fixed"}
    short_tail = fixed_clips(84, FPS, rule)  # last window 0.4 s < min_clip_s: dropped
    assert [(c.start, c.end) for c in short_tail] == [(0, 20), (20, 40), (40, 60), (60, 80)]
    overlap = fixed_clips(50, FPS, ClipRule(mode="fixed", window_s=2.0, stride_s=1.0, min_clip_s=0.5))
    assert [(c.start, c.end) for c in overlap] == [(0, 20), (10, 30), (20, 40), (30, 50)]
    gaps = fixed_clips(100, FPS, ClipRule(mode="fixed", window_s=2.0, stride_s=3.0, allow_gaps=True))
    assert [(c.start, c.end) for c in gaps] == [(0, 20), (30, 50), (60, 80), (90, 100)]


def test_video_shorter_than_min_clip_is_one_whole_clip():
    for rule in (ClipRule(mode="fixed", window_s=2.0, min_clip_s=1.0),
                 ClipRule(mode="scenes", window_s=2.0, min_clip_s=1.0)):
        make = fixed_clips if rule.mode == "fixed" else (lambda n, f, r: scene_clips([3], n, f, r))
        clips = make(7, FPS, rule)
        assert [(c.index, c.start, c.end) for c in clips] == [(0, 0, 7)]


def test_scene_shots_merged_and_split():
    rule = ClipRule(mode="scenes", window_s=3.0, min_clip_s=1.0)
    # shots: [0,23) [23,57) [57,62) [62,100): [57,62) is 0.5 s -> joins the previous: [23,62) is 3.9 s >
    # window: split at 3 s, its 0.9 s remainder and the 3 s piece evened out; [62,100) the same (0.8 s tail)
    clips = scene_clips([23, 57, 62], 100, FPS, rule)
    assert [(c.start, c.end) for c in clips] == [(0, 23), (23, 43), (43, 62), (62, 81), (81, 100)]
    assert [c.index for c in clips] == list(range(5)) and {c.source for c in clips} == {"scenes"}
    first_short = scene_clips([5, 40], 60, FPS, rule)  # the first shot 0.5 s joins the next: 4 s, split
    assert [(c.start, c.end) for c in first_short] == [(0, 30), (30, 40), (40, 60)]


# ---------------------------------------------------------------- decode: real encoded video


@pytest.mark.slow
@pytest.mark.parametrize("width", [128, 512], ids=["as-is", "area-averaged"])  # 512: `small_bgr` scales it to DETECT_WIDTH
def test_scene_cuts_detected_within_one_frame(tmp_path, width):
    data = _video(tmp_path, 90, width=width, height=width * 3 // 4)
    rule = ClipRule(mode="scenes", window_s=10.0, min_clip_s=0.5)
    for detector in ("content", "adaptive"):
        out = list(decode_clips(data, ClipRule(**{**rule.__dict__, "detector": detector}), FrameSampling(fps=2.0)))
        starts = [c.start for c, _ in out]
        assert len(starts) == len(CUTS) + 1, (detector, starts)
        for got, want in zip(starts[1:], CUTS, strict=True):
            assert abs(got - want) <= 1, (detector, starts)
        assert out[-1][0].end == 90 and all(c.source == "scenes" for c, _ in out)


def test_clip_frames_and_timestamps_are_relative_to_the_clip(tmp_path):
    data = _video(tmp_path, 90)
    sampling = FrameSampling(fps=2.0, min_frames=2)
    out = list(decode_clips(data, ClipRule(mode="fixed", window_s=3.0, min_clip_s=0.5), sampling))
    assert [(c.start, c.end) for c, _ in out] == [(0, 30), (30, 60), (60, 90)]
    for clip, vc in out:
        assert vc.total_frames == clip.frames and vc.source_fps == pytest.approx(FPS)
        assert vc.indices == tuple(clip_indices(clip, sampling).tolist())
        assert vc.timestamps[0] == 0.0  # the model's timestamps start at the clip's start
        for f, rel in zip(vc.frames, vc.indices, strict=True):  # each frame is the source frame start + rel
            want = scenes_pattern(clip.start + rel, 128, 96)
            assert np.abs(f.astype(int) - want.astype(int)).mean() < 12


def test_detector_failure_falls_back_to_fixed_windows(tmp_path):
    data = _video(tmp_path, 60)

    class Broken:  # a detector that raises on its first frame (stands in for a library failure)
        def __init__(self, rule, fps):
            pass

        def feed(self, i, frame):
            raise RuntimeError("detector broke")

    out = list(decode_clips(data, ClipRule(mode="scenes", window_s=2.0), FrameSampling(fps=2.0), detector=Broken))
    assert [(c.start, c.end, c.source) for c, _ in out] == [(0, 20, "fixed"), (20, 40, "fixed"), (40, 60, "fixed")]


def test_header_claiming_more_frames_clips_only_what_decodes(tmp_path):
    path = tmp_path / "long.mp4"
    encode_video(path, 120, 128, 96, FPS, options={"g": "12", "bf": "2"}, pattern=scenes_pattern,
                 container_options={"movflags": "+faststart"})
    full = path.read_bytes()
    cut = full[: len(full) // 2]  # moov (first) says 120 frames; half the data is there
    out = list(decode_clips(cut, ClipRule(mode="fixed", window_s=2.0, min_clip_s=0.1), FrameSampling(fps=2.0)))
    assert out and out[-1][0].end < 120
    ends = [c.end for c, _ in out]
    assert ends == sorted(ends) and all(isinstance(v, object) and v.frames.shape[0] > 0 for _, v in out)


def test_short_video_is_one_clip(tmp_path):
    data = _video(tmp_path, 6, "short.mp4")  # 0.6 s < min_clip_s 1 s
    out = list(decode_clips(data, ClipRule(mode="scenes", window_s=2.0), FrameSampling(fps=2.0, min_frames=2)))
    assert [(c.index, c.start, c.end) for c, _ in out] == [(0, 0, 6)]


# ---------------------------------------------------------------- the decode stage (Ray-free)


def test_decode_stage_streams_clip_rows_and_drops_committed_clips(tmp_path):
    from vlbatch.operators.sink.ids import IdIndex
    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.requests import clip_request_id, request_id
    from vlbatch.pipeline.stages.rows import Decoded, MediaTask, from_table, to_table

    data = _video(tmp_path, 60)
    clips = {"mode": "fixed", "window_s": 2.0}
    cfg = validate_config({**MIN, "video": {"fps": 2.0, "min_frames": 2, "clips": clips}})
    rid = request_id("v.mp4", 0, "What happens?")
    task = MediaTask("v.mp4", "video", (rid,), (0,), ("What happens?",), media_bytes=data)
    bad = MediaTask("bad.mp4", "video", ("b" * 32,), (0,), ("What happens?",), media_bytes=b"not a video" * 9)
    batch = to_table([task, bad], MediaTask)

    stage = DecodeStage(cfg)
    try:
        rows = [r for t in stage(batch) for r in from_table(t, Decoded)]
        ids = [clip_request_id(rid, k) for k in range(3)]
        assert [(r.ids, r.clip_index, r.clip_start_s, r.clip_end_s, r.clip_source) for r in rows[:3]] == [
            ((ids[k],), k, 2.0 * k, 2.0 * k + 2, "fixed") for k in range(3)]
        assert all(r.status == "ok" and r.total_frames == 20 and r.frames.shape[0] == 4 for r in rows[:3])
        (err,) = rows[3:]  # the whole file fails: one error row under the video's own id, no clip fields
        assert err.ids == bad.ids and err.status == "error" and err.error_type == "MediaError"
        assert err.clip_index is None and err.media_bytes is None

        again = DecodeStage(cfg, done=IdIndex.of([ids[0], ids[2]]))  # resume: clips 0 and 2 committed
        try:
            left = [r for t in again(to_table([task], MediaTask)) for r in from_table(t, Decoded)]
        finally:
            again.worker.close()
        assert [(r.ids, r.clip_index) for r in left] == [((ids[1],), 1)]
    finally:
        stage.worker.close()
