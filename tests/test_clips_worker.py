"""Video clips decoded in the killable decoder child (issues 51 + 54): `DecodeWorker.decode_clips`.

The child runs `clip_decode.decode_clips` and streams each clip's header and sampled frames back
through the parent's frame ring, clip by clip; the timeout bounds the time between two clips.
A hang and a crash mid-video are test-only decoders (PyAV that blocks forever / SIGSEGVs itself
after `AFTER` pictures) run in the real child, selected by "module:Class" backend names, as in
tests/test_media_worker.py.
"""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from test_clips import MIN, scenes_pattern

from vlbatch.devtools.samples import encode_video
from vlbatch.operators.errors import MediaError, MediaTimeoutError
from vlbatch.operators.media.clip_decode import decode_clips
from vlbatch.operators.media.clips import ClipRule
from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder
from vlbatch.operators.media.video import FrameSampling
from vlbatch.operators.media.worker import DecodeWorker
from vlbatch.pipeline.config import validate_config

FPS = 10
AFTER = 25  # pictures decoded before the test decoders stop: 1 s windows 0-1 are sent, window 2 is not
RULE = ClipRule(mode="fixed", window_s=1.0, min_clip_s=0.5)
SAMPLING = FrameSampling(fps=4.0, min_frames=2)


class _StopsAfter(PyAVDecoder):
    """Test-only: PyAV (as the clip decode opens it) whose picture stream calls `stop` before picture AFTER."""

    def __init__(self, threads: int = 1):
        super().__init__(threads, skip_nonref=False)

    def open(self, data):
        video = super().open(data)
        pictures = video.stream_all

        def stream_all():
            for n, picture in enumerate(pictures()):
                if n == AFTER:
                    self.stop()
                yield picture

        video.stream_all = stream_all
        return video


class HangsAfter(_StopsAfter):
    def stop(self):
        threading.Event().wait()  # no timeout: only SIGKILL ends this (a native FFmpeg hang)


class CrashesAfter(_StopsAfter):
    def stop(self):
        os.kill(os.getpid(), signal.SIGSEGV)  # a native decoder bug


HANG = f"{__name__}:HangsAfter"
CRASH = f"{__name__}:CrashesAfter"


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    path = tmp_path_factory.mktemp("cw") / "scenes.mp4"  # hard cuts at 23, 57, 71 (test_clips.CUTS)
    encode_video(path, 90, 128, 96, FPS, options={"g": "12", "bf": "2"}, pattern=scenes_pattern)
    return path.read_bytes()


def _same(got, want) -> None:
    assert [c for c, _ in got] == [c for c, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert (a.source_fps, a.total_frames, a.indices) == (b.source_fps, b.total_frames, b.indices)
        np.testing.assert_array_equal(a.frames, b.frames)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("rule", [
    ClipRule(mode="fixed", window_s=2.0, stride_s=1.5, min_clip_s=0.5),  # overlapping windows
    ClipRule(mode="scenes", window_s=3.0, min_clip_s=0.5),
], ids=["fixed", "scenes"])
def test_clips_through_the_child_equal_in_process_clips(video, rule):
    """Frame for frame what `decode_clips` gives in-process, clip by clip, through one child and one ring
    sized to a clip's frames (main: DecodeWorker has no clip path; clips decode in the actor's process)."""
    want = list(decode_clips(video, rule, SAMPLING))
    assert len(want) >= 4
    with DecodeWorker(timeout_s=60) as w:
        got = list(w.decode_clips(video, rule, SAMPLING))
        again = list(w.decode_clips(video, rule, SAMPLING))  # the same child: its pipe stayed in step
        assert w.starts == 1
        assert w._ring.mapped_bytes <= max(v.frames.nbytes for _, v in want) + 4096  # one clip's frames at most
        stopped = w.decode_clips(video, rule, SAMPLING)
        _same([next(stopped)], want[:1])
        stopped.close()  # a caller that stops early: the child's pipe is out of step, so it is killed
        assert w.pid is None
        _same(list(w.decode_clips(video, rule, SAMPLING)), want)
    _same(got, want)
    _same(again, want)


# The time limit: short where the test waits it out (a hang); long for a crash, whose EOF comes only once the
# kernel has written the dying child's core (seconds on a loaded machine), so a crash is never read as a timeout.
LIMIT_S = {HANG: 8, CRASH: 120}


@pytest.mark.parametrize(("backend", "error", "match"), [
    (HANG, MediaTimeoutError, "limit"),
    (CRASH, MediaError, "died"),
], ids=["hang", "crash"])
def test_a_child_stopping_between_clips_keeps_the_clips_sent(video, backend, error, match):
    """A hang (killed at the time limit between clips) or a crash after two clips: those two are the
    caller's, exact; the call then raises the typed error; the next video gets a fresh child."""
    want = list(decode_clips(video, RULE, SAMPLING))
    got = []
    with DecodeWorker(timeout_s=LIMIT_S[backend]) as w:
        w.start()
        pid = w.pid
        with pytest.raises(error, match=match):
            for item in w.decode_clips(video, RULE, SAMPLING, backend=backend):
                got.append(item)
        assert w.pid is None and not alive(pid)  # killed (or dead) and reaped
        _same(got, want[:2])
        _same(list(w.decode_clips(video, RULE, SAMPLING)), want)
        assert w.starts == 2


class _FirstWith(DecodeWorker):
    """The real worker whose first clip call names a test decoder (the batch's first video)."""

    def __init__(self, backend: str, **kw):
        super().__init__(**kw)
        self.first = backend

    def decode_clips(self, data, rule, sampling, backend="pyav"):
        backend, self.first = self.first or backend, None
        return super().decode_clips(data, rule, sampling, backend=backend)


@pytest.mark.parametrize(("backend", "error_type"), [(HANG, "MediaTimeoutError"), (CRASH, "MediaError")],
                         ids=["hang", "crash"])
def test_decode_stage_clip_rows_after_a_hang_or_crash_and_the_next_video(video, backend, error_type):
    """The CPU stage: the clips sent before the child stopped are ok rows; the video's remaining clips are
    one error row under the video's own ids (resume retries it; the committed clips are dropped then);
    the next video in the same batch decodes whole, in a fresh child."""
    from vlbatch.pipeline.stages.cpu import DecodeStage
    from vlbatch.pipeline.stages.requests import clip_request_id, request_id
    from vlbatch.pipeline.stages.rows import Decoded, MediaTask, from_table, to_table

    cfg = validate_config({**MIN, "video": {"fps": 4.0, "min_frames": 2, "decode_timeout_s": LIMIT_S[backend],
                                            "clips": {"mode": "fixed", "window_s": 1.0, "min_clip_s": 0.5}}})
    ids = [request_id(f"{k}.mp4", 0, "What happens?") for k in range(2)]
    tasks = [MediaTask(f"{k}.mp4", "video", (ids[k],), (0,), ("What happens?",), media_bytes=data)
             for k, data in enumerate((video, video))]
    stage = DecodeStage(cfg)
    stage.worker = _FirstWith(backend, timeout_s=LIMIT_S[backend])
    try:
        rows = [r for t in stage(to_table(tasks, MediaTask)) for r in from_table(t, Decoded)]
    finally:
        stage.worker.close()
    assert [(r.ids, r.clip_index, r.status) for r in rows[:3]] == [
        ((clip_request_id(ids[0], 0),), 0, "ok"), ((clip_request_id(ids[0], 1),), 1, "ok"), ((ids[0],), None, "error")]
    assert rows[2].error_type == error_type
    rest = rows[3:]  # the next video: all 9 clips of 1 s, ok
    assert [(r.ids, r.clip_index, r.status) for r in rest] == [
        ((clip_request_id(ids[1], k),), k, "ok") for k in range(9)]
    assert stage.worker.starts == 2


def test_a_child_repeating_a_clip_index_is_refused(tmp_path):
    """Clip ids are built from the index: a compromised child that repeats one (or skips one) would make
    two rows share an id; the parent refuses it (MediaError) and replaces the child."""
    import sys

    hostile = os.path.join(os.path.dirname(__file__), "hostile_decoder.py")
    with DecodeWorker(timeout_s=30, child_argv=[sys.executable, hostile, "clip-repeat", str(tmp_path / "m")]) as w:
        got = []
        with pytest.raises(MediaError, match="sent clip 0, expected clip 1"):
            for item in w.decode_clips(b"video", RULE, SAMPLING):
                got.append(item)
        assert [(c.index, type(e).__name__) for c, e in got] == [(0, "InputError")] and w.pid is None
