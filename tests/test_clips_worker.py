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
from types import SimpleNamespace

import numpy as np
import pytest
from test_clips import MIN, scenes_pattern
from test_media_worker import alive

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


@pytest.mark.parametrize("rule", [
    ClipRule(mode="fixed", window_s=2.0, stride_s=1.5, min_clip_s=0.5),  # overlapping windows
    ClipRule(mode="scenes", window_s=3.0, min_clip_s=0.5),
], ids=["fixed", "scenes"])
@pytest.mark.slow
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
@pytest.mark.slow
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

    def decode_clips(self, data, rule, sampling, backend="pyav", **kw):
        backend, self.first = self.first or backend, None
        return super().decode_clips(data, rule, sampling, backend=backend, **kw)


@pytest.mark.parametrize(("backend", "error_type"), [(HANG, "MediaTimeoutError"), (CRASH, "MediaError")],
                         ids=["hang", "crash"])
@pytest.mark.slow
def test_decode_stage_clip_rows_after_a_hang_or_crash_and_the_next_video(video, backend, error_type):
    """The CPU stage: the clips sent before the child stopped are ok rows; the video's remaining clips are
    one error row under the video's own ids (resume retries it; the committed clips are dropped then);
    the next video in the same batch decodes whole, in a fresh child."""
    from vlbatch.pipeline.stages.decode import DecodeStage
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


@pytest.mark.slow
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


def _target(tmp_path):
    from vlbatch.operators.media.clip_files import ClipFileSettings, ClipTarget
    from vlbatch.operators.storage import StorageOptions

    return ClipTarget(folder=str(tmp_path / "run" / "clips"), settings=ClipFileSettings(), storage=StorageOptions())


@pytest.mark.slow
def test_clip_files_encoded_in_the_child_are_frame_exact(video, tmp_path):
    """The child encodes each clip into the worker's local folder and names it in the clip's header; the
    caller's `on_file` stores it (clip_files.store_clip): every file decodes to exactly its clip's frames,
    and the worker's folder is empty after the call (main: `decode_clips` takes no clip files)."""
    import fsspec
    from test_clip_files import _check_frame_exact

    from vlbatch.operators.media.clip_files import ClipFileSettings, clip_file_name, store_clip

    target, stored, skipped = _target(tmp_path), {}, []

    def on_file(clip, file):
        assert file.refused is None and file.failed is None
        if file.path is None:  # a clip the child was told to skip
            skipped.append(clip.index)
            return
        assert os.path.dirname(file.path) == w._files_dir
        stored[clip.index] = store_clip(target, clip_file_name("v.mp4", clip.index), file.path)

    rule = ClipRule(mode="fixed", window_s=2.0, stride_s=1.5, min_clip_s=0.5)  # overlapping windows
    with DecodeWorker(timeout_s=60) as w:
        got = list(w.decode_clips(video, rule, SAMPLING, clip_files=ClipFileSettings(), skip=[0], on_file=on_file))
        assert os.listdir(w._files_dir) == []
        folder = w._files_dir
    assert not os.path.exists(folder)  # close removes the worker's folder
    _same(got, list(decode_clips(video, rule, SAMPLING)))
    assert skipped == [0] and sorted(stored) == [c.index for c, _ in got][1:]  # clip 0 (committed): not encoded
    rows = [SimpleNamespace(status="ok", clip_uri=stored[c.index], clip_index=c.index, clip_start_s=c.start_s,
                            clip_end_s=c.end_s) for c, _ in got[1:]]
    _check_frame_exact(rows, fsspec.filesystem("file"))


@pytest.mark.slow
def test_a_hang_with_clip_files_keeps_the_files_sent_and_no_temp_file(video, tmp_path):
    """The CPU stage with clip files, a child hanging after clip 1 (killed at the time limit): clips 0 and 1
    are ok rows with their files stored; the rest of the video is one error row and has no file; the killed
    child's temporary file (put in the worker's folder while clip 1 is stored, as a writer mid-encode would
    leave it) is deleted, never stored."""
    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.rows import Decoded, MediaTask, from_table, to_table

    cfg = validate_config({**MIN, "video": {"fps": 4.0, "min_frames": 2, "decode_timeout_s": LIMIT_S[HANG],
                                            "clips": {"mode": "fixed", "window_s": 1.0, "min_clip_s": 0.5}},
                           "output": {"uri": str(tmp_path / "out"), "clip_files": {"format": "mp4"}}})
    task = MediaTask("v.mp4", "video", ("a" * 32,), (0,), ("What happens?",), media_bytes=video)
    stage = DecodeStage(cfg)
    stage.worker.close()
    stage.worker = _HalfFileAt(1, HANG, timeout_s=LIMIT_S[HANG])
    stage.clip_target = _target(tmp_path)
    try:
        rows = [r for t in stage(to_table([task], MediaTask)) for r in from_table(t, Decoded)]
        assert stage.worker.half is not None and not os.path.exists(stage.worker.half)
        assert os.listdir(stage.worker._files_dir) == []
    finally:
        stage.worker.close()
    assert [(r.clip_index, r.status, r.error_type) for r in rows] == [
        (0, "ok", None), (1, "ok", None), (None, "error", "MediaTimeoutError")]
    assert rows[0].clip_uri and rows[1].clip_uri and rows[2].clip_uri is None
    names = sorted(os.listdir(tmp_path / "run" / "clips"))
    assert names == sorted(r.clip_uri.rsplit("/", 1)[1] for r in rows[:2])  # no file for the rest, no debris


class _HalfFileAt(_FirstWith):
    """The real worker that, when clip `at`'s file is handed over, leaves a half-written temporary file in
    its folder (what the child's writer leaves if killed mid-encode)."""

    def __init__(self, at: int, backend: str, **kw):
        super().__init__(backend, **kw)
        self.at, self.half = at, None

    def decode_clips(self, data, rule, sampling, backend="pyav", on_file=None, **kw):
        def hook(clip, file):
            if clip.index == self.at:
                self.half = os.path.join(self._files_dir, f"clip-{clip.index + 1}.mp4.{'ab' * 16}.vlbatch-tmp")
                with open(self.half, "wb") as f:
                    f.write(b"half a file")
            on_file(clip, file)

        return super().decode_clips(data, rule, sampling, backend, on_file=hook, **kw)


@pytest.mark.parametrize("name", ["../escape.mp4", "/etc/passwd", "sub/x.mp4", "..", "clip-0.mp4", "escape.mp4"])
def test_a_child_naming_a_clip_file_outside_its_folder_is_refused(tmp_path, name):
    """A compromised child naming a clip file outside the worker's folder (or a name that is not a file
    there) would make the parent store, then delete, someone else's file: refused (MediaError), the child
    replaced, `on_file` never called, and the named file untouched."""
    import sys

    from vlbatch.operators.media.clip_files import ClipFileSettings

    outside = tmp_path / "escape.mp4"
    outside.write_bytes(b"not the child's")
    hostile = os.path.join(os.path.dirname(__file__), "hostile_decoder.py")
    calls = []
    with DecodeWorker(timeout_s=30, child_argv=[sys.executable, hostile, "clip-file", name]) as w:
        folder = w._clip_folder()
        os.symlink(outside, os.path.join(folder, "escape.mp4"))  # a link in the folder is not a plain file either
        with pytest.raises(MediaError, match="refused"):
            list(w.decode_clips(b"video", RULE, SAMPLING, clip_files=ClipFileSettings(),
                                on_file=lambda c, f: calls.append(c)))
        assert calls == [] and w.pid is None and os.listdir(folder) == []
    assert outside.read_bytes() == b"not the child's"


def test_store_clip_refuses_a_link_swapped_in_after_the_name_check(tmp_path):
    """The child may replace its checked file with a link before the parent stores it: `store_clip` opens
    without following links, so the linked file is neither stored nor touched, and the link is deleted."""
    from vlbatch.operators.media.clip_files import store_clip

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"the parent's")
    folder = tmp_path / "child"
    folder.mkdir()
    os.symlink(secret, folder / "clip-0.mp4")
    target = _target(tmp_path)
    with pytest.raises(MediaError, match="cannot be opened as a file"):
        store_clip(target, "x", str(folder / "clip-0.mp4"))
    assert secret.read_bytes() == b"the parent's" and os.listdir(folder) == []
    assert not os.path.exists(target.folder) or os.listdir(target.folder) == []


def test_committed_clips_get_no_file_and_the_child_skips_the_first_ones(video, tmp_path):
    """Resume with clip files: clips 0-1 committed (told to the child: not encoded) and clip 4 committed after
    an uncommitted one (encoded by the child, dropped by the parent): no rows and no files for them; the
    others' files stored; the worker's folder empty."""
    from vlbatch.pipeline.stages.clip_rows import clip_rows
    from vlbatch.pipeline.stages.requests import clip_request_id
    from vlbatch.pipeline.stages.rows import MediaTask

    row = MediaTask("v.mp4", "video", ("a" * 32,), (0,), ("What happens?",))
    done = {clip_request_id("a" * 32, k) for k in (0, 1, 4)}
    target = _target(tmp_path)
    with DecodeWorker(timeout_s=60) as w:
        seen = []
        real = w.decode_clips

        def spy(*a, **kw):
            seen.append(kw["skip"])
            return real(*a, **kw)

        w.decode_clips = spy
        stage = SimpleNamespace(clips=RULE, sampling=SAMPLING, worker=w, done=done, clip_target=target)
        rows = list(clip_rows(stage, row, lambda _r: video))
        assert os.listdir(w._files_dir) == []
    assert seen == [[0, 1]]
    assert [(r.clip_index, r.status) for r in rows] == [(k, "ok") for k in (2, 3, 5, 6, 7, 8)]
    assert sorted(os.listdir(target.folder)) == sorted(r.clip_uri.rsplit("/", 1)[1] for r in rows)
