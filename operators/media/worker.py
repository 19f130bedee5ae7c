"""A killable decoder process: video decoding with a hard time limit.

Owns process isolation for decoding. decord's native loop cannot be interrupted
from Python (dmlc/decord #373) and a native crash would take the caller with it,
so decoding runs in a child process (`python -m vlbatch.operators.media.worker`, started
with `subprocess`, not `multiprocessing`: no re-import of the caller's `__main__`,
which matters inside Ray workers). The parent talks to it over a request socket and a reply
pipe (`vlbatch.operators.media.channel`) in the format of `vlbatch.operators.media.wire`: JSON
headers, never pickle, because the child parses
untrusted media and may be compromised by it; every header is checked before the parent
allocates for it. The video itself never crosses either: its file goes with the request as a
descriptor (SCM_RIGHTS), a local file the parent opened and checked (`storage.open_media`: the
decode stage's `MediaFile`), or bytes a caller holds written once into a sealed memfd, and the
child reads it where it lies, so a video's bytes are held once (a 459 MiB file: the process
tree's peak RSS 1786 MB with its bytes sent over a pipe, 485 MB handed over as a file; see
benchmarks/RESULTS.md).

Frames do not go through the pipe: the child writes each one into a slot of the parent's
shared-memory ring (`vlbatch.operators.media.ring`: a sealed memfd the parent creates once per
`DecodeWorker`, passed to every child as a third fd, reused across videos and children, closed by
`close`), sends its header, and the parent copies the slot into its preallocated output (one copy,
no syscall per 64 KB) and credits the slot back. So the child never holds more than its backend's
working set plus the ring, plus up to 64 MB of freed heap it keeps for the next frame (`CHILD_MALLOC`).
Every read and write waits at most until the call's deadline; past it the child is SIGKILLed and the
call raises `MediaTimeoutError`.
Clips (`video.clips`): `decode_clips` has the child cut the video (`clip_decode.stream_clips`) and
stream each clip's header and frames through the same ring, clip by clip (the ring sized to one
clip's frames, reused); its deadline runs from the last clip received, so the limit bounds the time
between two clips, and a hang or crash ends that video after the clips already yielded. With clip files,
the child also encodes each clip into this worker's local folder and names the file in its header; the
caller stores it; files of a killed child are deleted (the child never reaches the real output).
A child that dies (native crash) or breaks the protocol gives `MediaError`; frames already returned
are the parent's own and stay valid. The next call starts a fresh child (also when the child died
between calls). Start-up (imports, about 1 s; 3 s with TorchCodec's torch) is waited for separately
and never counts against a video's limit. A child is reused across calls and recycled after
`max_calls` to cap slow native leaks.

Threads: the child decodes with `threads` decoder threads (PyAV `thread_count`, TorchCodec
`num_ffmpeg_threads`, decord `num_threads`), as `decode_video_inprocess(threads=...)` would; it
inherits the parent's environment (OMP_NUM_THREADS: the parent's, else 1; Ray sets it to
an actor's CPUs).
Decoders stay warm per child, not per video: the chosen decoder's library is imported and
initialised before "ready" (`preload`); none of the three can reuse an open decoder for another
file (each is built over one file's bytes).
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from vlbatch.operators import errors
from vlbatch.operators.errors import MediaError
from vlbatch.operators.media import ring, wire
from vlbatch.operators.media.channel import Channel
from vlbatch.operators.media.child import CHILD_MALLOC, PRELOAD_ENV
from vlbatch.operators.media.clip_files import ClipFileSettings, empty_folder
from vlbatch.operators.media.clips import Clip, ClipRule
from vlbatch.operators.media.decoders.base import VideoData, data_size
from vlbatch.operators.media.video import DEFAULT_SAMPLING, FrameSampling
from vlbatch.operators.storage.media_file import MediaFile, memfd_of
from vlbatch.operators.types import VideoClip

STARTUP_TIMEOUT_S = 120.0  # generous: a loaded node can take seconds to import av + decord
CHILD_MODULE = "vlbatch.operators.media.worker"


class DecodeWorker:
    """One decoder child process, reused across calls. Not thread-safe: one call at a time.

    timeout_s: wall-clock limit per video (probe + decode + transfer);
    max_calls: recycle the child after this many videos;
    child_argv: the command before the three fd numbers (request socket, reply pipe, frame ring) (default:
    this module under the current interpreter); e.g. a sandbox wrapper, or a stand-in child in tests;
    preload: the decoder the calls will name (`video.decoder`); the child imports it before it says
    ready (TorchCodec imports torch: about 3 s of CPU and 700 MB, only where it is the one used).
    """

    def __init__(self, timeout_s: float = 60.0, max_calls: int = 500, threads: int = 1,
                 child_argv: Sequence[str] | None = None, preload: str = "auto"):
        if not timeout_s > 0:
            raise errors.ConfigError(f"decode timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.max_calls = max_calls
        self.threads = threads
        self.preload = preload
        self.child_argv = tuple(child_argv) if child_argv is not None else (sys.executable, "-m", CHILD_MODULE)
        self._proc: subprocess.Popen | None = None
        self._channel: Channel | None = None  # the running child's request socket and reply pipe
        self._ring: ring.FrameRing | None = None  # created with the first child, kept across children
        self._files_dir: str | None = None  # the child's clip files (`decode_clips(clip_files=)`), until `close`
        self._calls = 0
        self.starts = 0  # how many children were started (observable by tests and benchmarks)

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child now (it imports its decoder before "ready"), unless one is running."""
        if self._proc is None or self._proc.poll() is not None:
            self._drop()
            self._start()

    def _start(self) -> None:
        if self._ring is None:
            self._ring = ring.FrameRing()
        channel = Channel(self.timeout_s)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(CHILD_MALLOC)
        env[PRELOAD_ENV] = self.preload
        try:
            self._proc = subprocess.Popen(
                [*self.child_argv, *map(str, channel.child_fds), str(self._ring.fd)],
                pass_fds=(*channel.child_fds, self._ring.fd), env=env, stdin=subprocess.DEVNULL,
            )
        except BaseException:
            channel.close()
            raise
        channel.started()
        self._channel = channel
        self._calls = 0
        self.starts += 1
        # The child imports av, decord and numpy before it says ready, so start-up (about 1 s on a busy
        # node) never eats into a video's time limit.
        try:
            if self._channel.read_header(time.monotonic() + STARTUP_TIMEOUT_S) == {"kind": "ready"}:
                return
        except (EOFError, OSError, MediaError):  # no answer, a dead child, or not our protocol
            pass
        code = self._proc.poll()
        self._kill()
        raise MediaError(f"the decoder process failed to start (exit code {code})")

    def _close_pipes(self) -> None:
        self._channel.close()
        self._channel = None

    def close(self) -> None:
        """Stop the child (closing its request socket lets it exit; kill if it does not); free the ring."""
        self._stop()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._files_dir is not None:
            shutil.rmtree(self._files_dir, ignore_errors=True)
            self._files_dir = None

    def _stop(self) -> None:
        if self._proc is None:
            return
        self._close_pipes()
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _drop(self) -> None:
        """Forget a child that exited between calls (killed, crashed): reap it, close its pipes."""
        if self._proc is not None:
            self._proc.wait()
            self._close_pipes()
            self._proc = None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._close_pipes()
            self._proc = None

    def decode(self, data: VideoData, sampling: FrameSampling = DEFAULT_SAMPLING, backend: str = "auto") -> VideoClip:
        """Decode the sampled frames of `data` in the child within `timeout_s`.

        Raises `MediaError` (not a video, crash, a child breaking the protocol), `MediaTimeoutError`
        (over the limit; the child was killed), `InputError` (bad sampling), `ConfigError` (unknown backend).
        """
        return self._call(data, sampling, backend, plan_only=False)

    def plan(self, data: VideoData, sampling: FrameSampling = DEFAULT_SAMPLING) -> wire.ClipHeader:
        """The decode plan of `data` (the shared PyAV probe's metadata, the sampled indices, the
        output shape `(F, H, W, 3)` upright) without decoding a frame, in the child within
        `timeout_s`; raises as `decode` does. The deferred decode (`video.decode_device`) ships it."""
        return self._call(data, sampling, "pyav", plan_only=True)

    def decode_clips(self, data: VideoData, rule: ClipRule, sampling: FrameSampling = DEFAULT_SAMPLING,
                     backend: str = "pyav", clip_files: ClipFileSettings | None = None, skip: Iterable[int] = (),
                     on_file: Callable[[Clip, wire.ClipFile], None] | None = None,
                     ) -> Iterator[tuple[Clip, VideoClip | errors.VlbatchError]]:
        """`clip_decode.decode_clips` in the child: each clip of `data` with its sampled frames (or its own
        typed error) as soon as the child has sent it; `timeout_s` bounds the time this generator waits for
        the next clip (not the caller's time between clips). Clips yielded stay the caller's; then raises as
        `decode` does for the rest of the video (a hang, a crash, not a video). A generator closed early kills
        the child (its pipe is out of step). backend: PyAV ("module:Class" of a PyAV subclass: tests).
        clip_files: the child also encodes each clip not in `skip` into this worker's local folder, and
        `on_file(clip, wire.ClipFile)` is called before the clip is yielded (it stores or drops the file);
        whatever is left in the folder when the call ends (a killed child's files) is deleted."""
        files = None if clip_files is None else wire.ClipFiles(clip_files, self._clip_folder(), tuple(sorted(skip)))
        request = wire.encode_request(backend, self.threads, sampling, data_size(data), clips=rule, clip_files=files)
        for retry in (False, True):
            reused = self._begin()
            try:
                deadline = self._send(request, data)
                yield from self._receive_clips(sampling, deadline, files, on_file)
                return
            except (EOFError, OSError) as e:
                code, heard = self._reap()
                if reused and not heard and not retry:
                    continue  # a reused child gone before a byte of its answer: once more afresh
                raise MediaError(f"the decoder process died (exit code {code}) on this file") from e
            except _ChildError as e:
                raise e.error from None  # the child reported it and waits for the next request: keep it
            except BaseException:  # timeout, interrupt, bad message, closed early: out of step, start afresh
                self._kill()
                raise
            finally:
                if self._ring is not None:
                    self._ring.trim()
                if files is not None:
                    empty_folder(files.folder)

    def _clip_folder(self) -> str:
        """This worker's local folder for the child's clip files (made on first use, removed by `close`)."""
        if self._files_dir is None:
            self._files_dir = tempfile.mkdtemp(prefix="vlbatch-clipfiles-")
        return self._files_dir

    def _receive_clips(self, sampling: FrameSampling, deadline: float, files: wire.ClipFiles | None, on_file):
        """Yield (Clip, VideoClip | its own error) per "clip" until "done"; `_ChildError` for an "error"."""
        index = 0
        while True:
            header = self._channel.read_header(deadline)
            kind = header["kind"]
            if kind == "done":
                return
            if kind == "error":
                raise _ChildError(wire.child_error(header))
            if kind != "clip":
                raise MediaError(f"the decoder sent {kind[:50]!r} out of order ({index} clips in)")
            clip, plan = wire.parse_clip(header, index, sampling.max_output_bytes)
            file = wire.parse_clip_file(header, files.folder) if files is not None else None
            index += 1
            if not isinstance(plan, errors.VlbatchError):
                plan = self._clip_frames(plan, deadline)
            if file is not None and on_file is not None:
                on_file(clip, file)
            yield clip, plan
            deadline = time.monotonic() + self.timeout_s  # the limit runs from here, not from the caller's work

    def _clip_frames(self, plan: wire.ClipHeader, deadline: float) -> VideoClip:
        """One clip's `plan.shape[0]` frames from the ring into the parent's own array."""
        frames = np.empty(plan.shape, np.uint8)
        slots = self._offer_ring(plan.shape, deadline)
        for n in range(plan.shape[0]):
            header = self._channel.read_header(deadline)
            if header["kind"] != "frame":
                raise MediaError(f"the decoder sent {header['kind'][:50]!r} out of order ({n} frames in)")
            wire.check_frame(header, n, plan.shape[1:])
            self._ring.copy_out(n % slots, frames[n])
            self._channel.write(memoryview(ring.CREDIT), deadline)
        return VideoClip(frames=frames, source_fps=plan.source_fps, total_frames=plan.total_frames,
                         indices=plan.indices)

    def _begin(self) -> bool:
        """Ready a child for a call (recycled after `max_calls`); whether it is one reused from an earlier call.
        A child that died between calls is replaced by `start`, but a multi-threaded child killed a moment
        ago may not be reapable yet (its leader is a zombie until every thread has exited): a reused child
        that ends before a byte of its answer is no fault of this file, and the call runs once more afresh."""
        if self._proc is not None and self._calls >= self.max_calls:
            self._stop()
        reused = self._proc is not None and self._proc.poll() is None
        self.start()
        self._calls += 1
        self._channel.expect()
        return reused

    def _send(self, request: bytes, data: VideoData) -> float:
        """Send a request with the video's file attached (a `MediaFile`'s descriptor; bytes: written once
        into a sealed memfd, ours closed once sent); the call's deadline (from now)."""
        deadline = time.monotonic() + self.timeout_s
        if isinstance(data, MediaFile):
            self._channel.send_request(request, data.fd, deadline)
        else:
            with memfd_of(data) as file:
                self._channel.send_request(request, file.fd, deadline)
        return deadline

    def _reap(self) -> tuple[int | None, bool]:
        """A child gone mid-call: killed and reaped; (its exit code, whether this call heard a byte of its answer)."""
        code = self._proc.poll() if self._proc is not None else None
        heard = self._channel is not None and self._channel.heard
        self._kill()
        return code, heard

    def _call(self, data: VideoData, sampling: FrameSampling, backend: str, plan_only: bool):
        request = wire.encode_request(backend, self.threads, sampling, data_size(data), plan_only)
        reused = self._begin()
        try:
            deadline = self._send(request, data)
            try:
                clip, error = self._receive(sampling, deadline, plan_only)
            finally:
                self._ring.trim()
        except (EOFError, OSError) as e:
            code, heard = self._reap()
            if reused and not heard:
                return self._call(data, sampling, backend, plan_only)  # a fresh child: not reused, at most once
            raise MediaError(f"the decoder process died (exit code {code}) on this file") from e
        except BaseException:  # timeout, interrupt, bad message: the pipe is out of step, start afresh
            self._kill()
            raise
        if error is not None:
            raise error  # the child reported it and waits for the next request: keep it
        return clip

    def _offer_ring(self, shape: tuple[int, ...], deadline: float) -> int:
        """Size the ring for a checked plan `shape` `(F, H, W, 3)` and credit all its slots; the slot count."""
        frame_bytes = math.prod(shape[1:])
        slots = ring.ring_slots(frame_bytes, shape[0])
        self._ring.reserve(slots * frame_bytes)  # <= the plan's bytes, already checked against the limit
        self._channel.write(memoryview(ring.CREDIT * slots), deadline)
        return slots

    def _receive(self, sampling: FrameSampling, deadline: float,
                 plan_only: bool = False) -> tuple[VideoClip | wire.ClipHeader | None, errors.VlbatchError | None]:
        """Read one reply: (clip, None) (the plan's header with `plan_only`), or (None, the typed
        error the child reported)."""
        plan: wire.ClipHeader | None = None
        frames, filled, slots = None, 0, 1
        while True:
            header = self._channel.read_header(deadline)
            kind = header["kind"]
            if kind == "plan":  # a second plan restarts the slots (the PyAV recount)
                plan = wire.parse_plan(header, sampling.max_output_bytes)
                frames, filled = np.empty(plan.shape, np.uint8), 0
                if not plan_only:
                    slots = self._offer_ring(plan.shape, deadline)
            elif kind == "done" and plan is not None and plan_only:
                return plan, None
            elif kind == "frame" and plan is not None and filled < plan.shape[0] and not plan_only:
                wire.check_frame(header, filled, plan.shape[1:])
                self._ring.copy_out(filled % slots, frames[filled])  # into our own rows: the slot is free again
                filled += 1
                self._channel.write(memoryview(ring.CREDIT), deadline)
            elif kind == "done" and plan is not None and filled == plan.shape[0]:
                return VideoClip(frames=frames, source_fps=plan.source_fps, total_frames=plan.total_frames,
                                 indices=plan.indices), None
            elif kind == "error":
                return None, wire.child_error(header)
            else:
                raise MediaError(f"the decoder sent {kind[:50]!r} out of order ({filled} frames in)")


class _ChildError(Exception):
    """A whole-video error the child reported (it waits for the next request: kept)."""

    def __init__(self, error: errors.VlbatchError):
        super().__init__(str(error))
        self.error = error


def decode_video(data: VideoData, sampling: FrameSampling = DEFAULT_SAMPLING, backend: str = "auto",
                 timeout_s: float = 60.0, worker: DecodeWorker | None = None) -> VideoClip:
    """Decode sampled frames in a killable child. Pass a long-lived `worker` to avoid a start per call."""
    if worker is not None:
        return worker.decode(data, sampling, backend)
    with DecodeWorker(timeout_s=timeout_s, max_calls=1) as one_shot:
        return one_shot.decode(data, sampling, backend)


if __name__ == "__main__":  # the child's entry point (CHILD_MODULE): its loop is in `child`
    from vlbatch.operators.media.child import main

    main(sys.argv)
