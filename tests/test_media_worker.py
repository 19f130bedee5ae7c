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
import time

import numpy as np
import pytest

from vlbatch.devtools.samples import encode_video, frame_index
from vlbatch.operators.errors import ConfigError, InputError, MediaError, MediaTimeoutError, VlbatchError
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_one_shot_decode_and_config_errors(video):
    clip = decode_video(video, FrameSampling(num_frames=5), timeout_s=10)
    assert [frame_index(f) for f in clip.frames] == [0, 5, 10, 15, 20]
    with pytest.raises(ConfigError, match="^video.decoder: unknown video decoder .ffmpeg-cli.; allowed: "):
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


# A compromised child: `tests/hostile_decoder.py` speaks (or breaks) the protocol on the real pipes.
HOSTILE = os.path.join(os.path.dirname(__file__), "hostile_decoder.py")


class Evil:
    """The hostile child's payload: unpickling it creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def hostile(mode: str, marker, timeout_s: float = 10) -> DecodeWorker:
    import sys

    return DecodeWorker(timeout_s=timeout_s, child_argv=[sys.executable, HOSTILE, mode, str(marker)])


@pytest.mark.parametrize("mode", ["pickle-ready", "pickle-reply", "pickle-header"])
def test_a_child_sending_a_pickle_never_gets_it_executed(mode, tmp_path):
    import pickle

    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Evil(str(probe))))
    assert probe.exists()  # the payload is live: unpickling it does create the file
    marker = tmp_path / "pwned"
    with hostile(mode, marker) as w, pytest.raises(MediaError, match="failed to start" if mode == "pickle-ready"
                                                   else "malformed|refused"):
        w.decode(b"video")
    assert not marker.exists()


@pytest.mark.parametrize("mode", ["huge-length", "huge-plan", "huge-frame"])
def test_a_header_claiming_a_terabyte_is_refused_without_allocating(mode, tmp_path):
    import tracemalloc

    with hostile(mode, tmp_path / "unused", timeout_s=30) as w:
        tracemalloc.start()
        with pytest.raises(MediaError, match="refused|expected uint8") as e:
            w.decode(b"video")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert not isinstance(e.value, MediaTimeoutError)  # refused on reading the header, not stopped by the timeout
    assert peak < 16 << 20  # numpy and bytearray buffers are traced: nothing near the claimed size was allocated


def test_the_stand_in_child_speaks_the_protocol(tmp_path):
    """The baseline for the hostile modes: well-formed messages give a clip, and the child is kept."""
    with hostile("ok", tmp_path / "unused") as w:
        for _ in range(2):
            clip = w.decode(b"video")
            assert clip.frames.shape == (1, 2, 2, 3) and not clip.frames.any()
            assert (clip.source_fps, clip.total_frames, clip.indices) == (10.0, 4, (0,))
        assert w.starts == 1


@pytest.mark.parametrize("mode, match", [
    ("bad-json", "malformed header"),
    ("not-an-object", "not an object"),
    ("done-early", "'done' out of order"),  # never hands back uninitialised rows
    ("float-dtype", "expected uint8"),
])
def test_malformed_messages_are_media_errors_and_the_child_is_replaced(mode, match, tmp_path):
    with hostile(mode, tmp_path / "unused") as w:
        for starts in (1, 2):
            with pytest.raises(MediaError, match=match) as e:
                w.decode(b"video")
            assert not isinstance(e.value, MediaTimeoutError)
            assert w.starts == starts and w.pid is None  # killed: the pipe is out of step


@pytest.mark.parametrize("mode, cls", [
    ("error-InputError", InputError), ("error-EngineError", MediaError), ("error-dunder", MediaError),
])
def test_child_errors_map_only_to_allowed_classes(mode, cls, tmp_path):
    with hostile(mode, tmp_path / "unused") as w:
        with pytest.raises(VlbatchError) as e:
            w.decode(b"video")
        assert type(e.value) is cls
        pid = w.pid
        with pytest.raises(cls):
            w.decode(b"video")
        assert w.pid == pid and w.starts == 1  # a reported error keeps the child


# The shared-memory hand-off (issue 54): frames go through the parent's sealed ring, not the pipe.
class DyingDecoder(VideoDecoder):
    """Test-only: PyAV that SIGKILLs its own (child) process after handing over two frames."""

    name = "pyav"

    def open(self, data):
        from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder

        video = PyAVDecoder().open(data)
        frames = video.iter_frames

        def iter_frames(indices):
            for n, frame in enumerate(frames(indices)):
                if n == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield frame

        video.iter_frames = iter_frames
        return video


DYING = f"{__name__}:DyingDecoder"


class CutAfterTwoDecoder(VideoDecoder):
    """Test-only: PyAV whose stream 'ends' after two frames (ShortVideo), so the PyAV recount sends a
    second plan after frames of the first went through the ring."""

    name = "pyav"

    def open(self, data):
        from vlbatch.operators.media.decoders import ShortVideo
        from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder

        video = PyAVDecoder().open(data)
        frames = video.iter_frames

        def iter_frames(indices):
            for n, frame in enumerate(frames(indices)):
                if n == 2:
                    raise ShortVideo("cut here (test)")
                yield frame

        video.iter_frames = iter_frames
        return video


def test_a_second_plan_after_frames_keeps_the_ring_in_step(video):
    """The recount's second plan comes after two frames of the first: the child takes the first plan's
    credits before it, and the clip is the recount's, as in-process."""
    sampling = FrameSampling(fps=10)
    with DecodeWorker(timeout_s=30) as w:
        clip = w.decode(video, sampling, backend=f"{__name__}:CutAfterTwoDecoder")
        again = w.decode(video, sampling, backend="pyav")  # the same child: its pipe is in step
        assert w.starts == 1
    ref = decode_video_inprocess(video, sampling, backend="pyav")
    np.testing.assert_array_equal(clip.frames, ref.frames)
    np.testing.assert_array_equal(again.frames, ref.frames)


def ring_fds() -> list[str]:
    """This process's open memfd rings (`/proc/self/fd` links read `/memfd:vlbatch-decode-ring (deleted)`)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the fd listdir itself used, closed by now
    return [link for link in links if "vlbatch-decode-ring" in link]


def zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" in f.read()
    except FileNotFoundError:
        return True


def test_frames_come_through_shared_memory_not_the_pipe(video):
    """The child writes headers to the pipe and pixels to the ring: its write() bytes stay far below the frames'."""
    with DecodeWorker(timeout_s=30) as w:
        w.decode(video, FrameSampling(num_frames=4))  # the child started and warm

        def written() -> int:
            with open(f"/proc/{w.pid}/io") as f:
                return int(next(line for line in f if line.startswith("wchar:")).split()[1])

        before = written()
        clip = w.decode(video, FrameSampling(fps=10), backend="pyav")  # all 21 frames: 193 KB of pixels
        assert clip.frames.nbytes == 21 * 48 * 64 * 3
        assert written() - before < clip.frames.nbytes // 8  # JSON headers only (main: every pixel byte)
        assert w._ring.mapped_bytes <= clip.frames.nbytes + 4096  # the ring never exceeds the plan's frames
        assert w.plan(video, FrameSampling(fps=10)).shape == clip.frames.shape  # a plan: no frames, no credits
        np.testing.assert_array_equal(w.decode(video, FrameSampling(fps=10), "pyav").frames, clip.frames)
        assert w.starts == 1  # the pipe stayed in step through all three
    np.testing.assert_array_equal(clip.frames, decode_video_inprocess(video, FrameSampling(fps=10), "pyav").frames)


@pytest.mark.slow
def test_a_child_killed_while_the_parent_holds_its_frames(video):
    """Frames returned are the parent's own copy: a child killed after (or during) a hand-off changes
    nothing in them, the next call starts a fresh child on the same ring, and close frees the ring
    (no /dev/shm segment, no memfd left open)."""
    shm_before = sorted(os.listdir("/dev/shm"))
    sampling = FrameSampling(fps=4)
    with DecodeWorker(timeout_s=30) as w:
        held = w.decode(video, sampling, backend="pyav")
        kept = held.frames.copy()
        pid, open_rings = w.pid, ring_fds()  # the memfd and its mapping's own dup
        os.kill(pid, signal.SIGKILL)  # killed between calls, while we hold its frames
        deadline = time.monotonic() + 20
        while not zombie_or_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.02)  # polling an external process's state with a deadline
        np.testing.assert_array_equal(held.frames, kept)
        again = w.decode(video, sampling, backend="pyav")  # main: MediaError "died" (it wrote to the dead child)
        assert w.starts == 2 and w.pid != pid
        np.testing.assert_array_equal(again.frames, kept)
        assert open_rings
        with pytest.raises(MediaError, match="died"):  # killed mid-hand-off, two frames in the ring
            w.decode(video, sampling, backend=DYING)
        np.testing.assert_array_equal(held.frames, kept)
        np.testing.assert_array_equal(again.frames, kept)
        assert ring_fds() == open_rings  # one ring for all three children
        np.testing.assert_array_equal(w.decode(video, sampling, backend="pyav").frames, kept)
        assert w.starts == 3
    assert ring_fds() == []
    assert sorted(os.listdir("/dev/shm")) == shm_before


@pytest.mark.slow
def test_a_child_killed_just_before_a_call_costs_that_video_nothing(video):
    """A child killed an instant before the next call (the OOM killer between videos) may still look alive: a
    multi-threaded child's leader stays unreapable until its threads exit. The call finds it gone before a byte
    of the answer and runs once more on a fresh child; the video is decoded, not an error row."""
    sampling = FrameSampling(fps=4)
    with DecodeWorker(timeout_s=30) as w:
        kept = w.decode(video, sampling, backend="pyav").frames.copy()
        for _ in range(5):
            os.kill(w.pid, signal.SIGKILL)  # no wait: the next call races the child's exit
            np.testing.assert_array_equal(w.decode(video, sampling, backend="pyav").frames, kept)
        assert w.starts == 6


def test_the_ring_cannot_be_shrunk_under_the_parent():
    """A compromised child holds the ring's fd: truncating it would SIGBUS the parent's next read, so it is sealed."""
    from vlbatch.operators.media.ring import FrameRing

    r = FrameRing()
    try:
        r.reserve(1 << 20)
        with pytest.raises(PermissionError):
            os.ftruncate(r.fd, 0)
        import fcntl

        with pytest.raises(PermissionError):  # and the seals cannot be changed
            fcntl.fcntl(r.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        os.ftruncate(r.fd, 2 << 20)  # growing stays allowed (the parent grows it for larger frames)
    finally:
        r.close()


def test_the_ring_gives_back_what_one_large_video_grew_it_to():
    """Memory stays bounded across videos: after a video whose frames grew the ring past RING_BYTES (two 4K
    frames are 50 MB), the pages above it are handed back; what stays is reused by the next video."""
    from vlbatch.operators.media.ring import RING_BYTES, ChildRing, FrameRing, ring_slots

    assert ring_slots(3840 * 2160 * 3, 20) == 2 and ring_slots(854 * 480 * 3, 1200) == 13
    assert ring_slots(100, 3) == 3  # never more slots than the plan's frames
    r = FrameRing()
    try:
        r.reserve(4 * RING_BYTES)
        child = ChildRing(r.fd).slots(4, (RING_BYTES,))
        child[:] = 7  # the child fills all four slots
        assert os.fstat(r.fd).st_blocks * 512 == 4 * RING_BYTES
        r.trim()
        assert os.fstat(r.fd).st_blocks * 512 == RING_BYTES
        assert child[0, :3].tolist() == [7, 7, 7] and not child[3].any()  # the kept share is untouched
        del child
    finally:
        r.close()


def test_the_child_keeps_its_freed_frame_buffers_for_the_next_frame(video):
    """The child's glibc malloc keeps freed heap for reuse (`CHILD_MALLOC`): with the defaults, each frame's freed
    buffer was the top of the child's small heap, trimmed and faulted in again for the next frame (issue 54)."""
    from vlbatch.operators.media.child import CHILD_MALLOC

    with DecodeWorker(timeout_s=30) as w:
        w.decode(video, FrameSampling(num_frames=4), backend="pyav")
        with open(f"/proc/{w.pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert {k.encode(): v.encode() for k, v in CHILD_MALLOC.items()}.items() <= env.items()
    assert int(CHILD_MALLOC["MALLOC_MMAP_THRESHOLD_"]) >= 3840 * 2160 * 3  # a 4K RGB frame comes from the heap
