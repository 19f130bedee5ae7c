"""The killable decoder process: time limit, crashes, reuse and recycling.

The hang is simulated honestly with a test-only backend (`HangingDecoder` below)
that blocks forever inside the child's `open`, the way decord's native loop blocks
(it never returns to Python); a real decord hang needs a file we cannot craft
reliably. The crash is a test-only backend that kills its own process with SIGSEGV.
Both run in the real child process, selected by "module:Class" backend names.
"""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from vlbatch.devtools.samples import encode_video, frame_index
from vlbatch.operators.errors import ConfigError, MediaError, MediaTimeoutError
from vlbatch.operators.media.decoders.base import VideoDecoder
from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess
from vlbatch.operators.media.worker import DecodeWorker, decode_video


class HangingDecoder(VideoDecoder):
    """Test-only: blocks forever in the child, never returning to the caller."""

    name = "hang"

    def open(self, data):
        threading.Event().wait()  # no timeout: only SIGKILL ends this


class CrashingDecoder(VideoDecoder):
    """Test-only: the child dies by a signal, as a native decoder bug would."""

    name = "crash"

    def open(self, data):
        os.kill(os.getpid(), signal.SIGSEGV)


HANG = f"{__name__}:HangingDecoder"
CRASH = f"{__name__}:CrashingDecoder"


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "clip.mp4"
    encode_video(path, 21, 64, 48, 10, options={"bf": "2", "g": "8"})
    return path.read_bytes()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hung_decode_is_killed_and_the_worker_recovers(video):
    with DecodeWorker(timeout_s=2.5) as w:
        first = w.decode(video, FrameSampling(fps=2))
        pid = w.pid
        with pytest.raises(MediaTimeoutError, match="2.5 s limit") as e:
            w.decode(video, FrameSampling(fps=2), backend=HANG)
        assert not e.value.permanent  # resume retries timeouts
        assert not alive(pid)  # SIGKILLed and reaped, not left hanging
        again = w.decode(video, FrameSampling(fps=2))
        assert w.starts == 2 and w.pid != pid
        np.testing.assert_array_equal(first.frames, again.frames)


def test_a_crashing_decoder_gives_media_error_not_a_crash(video):
    with DecodeWorker(timeout_s=10) as w:
        with pytest.raises(MediaError, match="died") as e:
            w.decode(video, backend=CRASH)
        assert not isinstance(e.value, MediaTimeoutError)
        assert w.decode(video, FrameSampling(num_frames=3)).frames.shape == (3, 48, 64, 3)


def test_worker_is_reused_and_recycled(video):
    with DecodeWorker(timeout_s=10, max_calls=2) as w:
        w.decode(video)
        pid = w.pid
        w.decode(video, backend="pyav")
        assert w.pid == pid and w.starts == 1
        w.decode(video)
        assert w.starts == 2 and not alive(pid)


def test_worker_output_equals_in_process_decode(video):
    sampling = FrameSampling(fps=4)
    with DecodeWorker(timeout_s=10) as w:
        clip = w.decode(video, sampling, backend="pyav")
    ref = decode_video_inprocess(video, sampling, backend="pyav")
    assert clip.indices == ref.indices and clip.total_frames == 21 and clip.source_fps == 10.0
    np.testing.assert_array_equal(clip.frames, ref.frames)
    assert [frame_index(f) for f in clip.frames] == list(clip.indices)


def test_one_shot_decode_and_config_errors(video):
    clip = decode_video(video, FrameSampling(num_frames=5), timeout_s=10)
    assert [frame_index(f) for f in clip.frames] == [0, 5, 10, 15, 20]
    with pytest.raises(ConfigError, match="unknown video backend"):
        decode_video(video, backend="ffmpeg-cli", timeout_s=10)
    with pytest.raises(ConfigError):
        DecodeWorker(timeout_s=0)


def test_the_child_exits_when_its_parent_dies(video, tmp_path):
    """A killed Ray actor must not leave decoder children behind: EOF on the request pipe ends them."""
    import subprocess
    import sys
    import time

    src = tmp_path / "clip.mp4"
    src.write_bytes(video)
    script = (
        "import os, sys\n"
        "from vlbatch.operators.media.worker import DecodeWorker\n"
        "w = DecodeWorker(timeout_s=30)\n"
        f"w.decode(open({str(src)!r}, 'rb').read())\n"
        "print(w.pid, flush=True)\n"
        "os._exit(0)  # no close(): the parent just dies\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[-1])

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                return "State:\tZ" in f.read()  # exited, waiting to be reaped by init
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 20
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling an external process with a deadline, not standing in for a sync
    assert gone()
