"""A killable decoder process: video decoding with a hard time limit.

Owns process isolation for decoding. decord's native loop cannot be interrupted
from Python (dmlc/decord #373) and a native crash would take the caller with it,
so decoding runs in a child process (`python -m vlbatch.operators.media.worker`, started
with `subprocess`, not `multiprocessing`: no re-import of the caller's `__main__`,
which matters inside Ray workers). The parent talks to it over two pipes with
`multiprocessing.connection.Connection` framing:

    parent -> child: (backend, threads, sampling) then the video bytes
    child -> parent: ("plan", Plan) | ("frame", slot, nbytes) + nbytes raw bytes | ("done",) | ("error", type, msg)

Frames stream one at a time straight into the parent's preallocated output
(`os.readv` into the destination rows: one copy), so the child never holds more
than its backend's working set. Every read waits at
most until the call's deadline; past it the child is SIGKILLed and the call raises
`MediaTimeoutError`. A child that dies (native crash) gives `MediaError`. The
next call starts a fresh child. Start-up (imports, about 1 s) is waited for
separately and never counts against a video's limit. A child is reused across
calls and recycled after `max_calls` to cap slow native leaks.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from vlbatch.operators import errors
from vlbatch.operators.errors import MediaError, MediaTimeoutError
from vlbatch.operators.media.video import DEFAULT_SAMPLING, FrameSampling, Plan, decode_stream
from vlbatch.operators.types import VideoClip

STARTUP_TIMEOUT_S = 120.0  # generous: a loaded node can take seconds to import av + decord


class DecodeWorker:
    """One decoder child process, reused across calls. Not thread-safe: one call at a time.

    timeout_s: wall-clock limit per video (probe + decode + transfer);
    max_calls: recycle the child after this many videos.
    """

    def __init__(self, timeout_s: float = 60.0, max_calls: int = 500, threads: int = 1):
        if not timeout_s > 0:
            raise errors.ConfigError(f"decode timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.max_calls = max_calls
        self.threads = threads
        self._proc: subprocess.Popen | None = None
        self._calls = 0
        self.starts = 0  # how many children were started (observable by tests and benchmarks)

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vlbatch.operators.media.worker", str(req_r), str(res_w)],
            pass_fds=(req_r, res_w), env=env, stdin=subprocess.DEVNULL,
        )
        os.close(req_r)
        os.close(res_w)
        self._send = Connection(req_w, readable=False)
        self._recv = Connection(res_r, writable=False)
        self._calls = 0
        self.starts += 1
        # The child imports av, decord and numpy before it says ready, so start-up (about 1 s on a busy
        # node) never eats into a video's time limit.
        try:
            if self._recv.poll(STARTUP_TIMEOUT_S) and self._recv.recv() == ("ready",):
                return
        except (EOFError, OSError):
            pass
        code = self._proc.poll()
        self._kill()
        raise MediaError(f"the decoder process failed to start (exit code {code})")

    def close(self) -> None:
        """Stop the child (closing its request pipe lets it exit; kill if it does not)."""
        if self._proc is None:
            return
        self._send.close()
        self._recv.close()
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._send.close()
            self._recv.close()
            self._proc = None

    def decode(self, data: bytes, sampling: FrameSampling = DEFAULT_SAMPLING, backend: str = "decord") -> VideoClip:
        """Decode the sampled frames of `data` in the child within `timeout_s`.

        Raises `MediaError` (not a video, crash), `MediaTimeoutError` (over the limit;
        the child was killed), `InputError` (bad sampling), `ConfigError` (unknown backend).
        """
        if self._proc is None or self._calls >= self.max_calls:
            self.close()
            self._start()
        self._calls += 1
        deadline = time.monotonic() + self.timeout_s
        try:
            self._send.send((backend, self.threads, sampling))
            self._send.send_bytes(data)
            clip, error = self._receive(deadline)
        except (EOFError, OSError) as e:
            code = self._proc.poll() if self._proc is not None else None
            self._kill()
            raise MediaError(f"the decoder process died (exit code {code}) on this file") from e
        except BaseException:  # timeout, interrupt, bad message: the pipe is out of step, start afresh
            self._kill()
            raise
        if error is not None:
            raise error  # the child reported it and waits for the next request: keep it
        return clip

    def _wait(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not self._recv.poll(left):
            raise MediaTimeoutError(f"decoding took longer than the {self.timeout_s:g} s limit; the decoder was killed")

    def _read_into(self, out: memoryview, deadline: float) -> None:
        """Read exactly `out.nbytes` raw bytes from the child straight into `out` (one copy, no framing)."""
        fd, got = self._recv.fileno(), 0
        while got < out.nbytes:
            self._wait(deadline)
            n = os.readv(fd, [out[got:]])
            if n == 0:
                raise EOFError("the decoder process closed its pipe mid-frame")
            got += n

    def _receive(self, deadline: float) -> tuple[VideoClip | None, errors.VlbatchError | None]:
        """Read one reply: (clip, None), or (None, the typed error the child reported)."""
        plan: Plan | None = None
        frames = None
        while True:
            self._wait(deadline)
            msg = self._recv.recv()
            if msg[0] == "plan":
                plan = msg[1]
                frames = np.empty(plan.shape, np.uint8)  # restarts on a second plan
            elif msg[0] == "frame":
                _, slot, nbytes = msg
                out = memoryview(frames[slot].reshape(-1))
                if nbytes != out.nbytes:
                    raise MediaError(f"decoder sent a frame of {nbytes} bytes, expected {out.nbytes}")
                self._read_into(out, deadline)
            elif msg[0] == "done":
                return VideoClip(frames=frames, source_fps=plan.info.fps, total_frames=plan.info.frames,
                                 indices=plan.indices), None
            else:
                _, kind, text = msg
                cls = getattr(errors, kind, MediaError)
                return None, (cls if isinstance(cls, type) and issubclass(cls, errors.VlbatchError) else MediaError)(text)


def decode_video(data: bytes, sampling: FrameSampling = DEFAULT_SAMPLING, backend: str = "decord",
                 timeout_s: float = 60.0, worker: DecodeWorker | None = None) -> VideoClip:
    """Decode sampled frames in a killable child. Pass a long-lived `worker` to avoid a start per call."""
    if worker is not None:
        return worker.decode(data, sampling, backend)
    with DecodeWorker(timeout_s=timeout_s, max_calls=1) as one_shot:
        return one_shot.decode(data, sampling, backend)


def _serve(req: Connection, res: Connection) -> None:
    """Child loop: one request at a time until the parent closes the request pipe."""
    while True:
        try:
            backend, threads, sampling = req.recv()
            data = req.recv_bytes()
        except EOFError:
            return
        try:
            for item in decode_stream(data, sampling, backend, threads):
                if isinstance(item, Plan):
                    res.send(("plan", item))
                else:
                    slot, frame = item
                    raw = memoryview(np.ascontiguousarray(frame)).cast("B")
                    res.send(("frame", slot, raw.nbytes))
                    _write_all(res.fileno(), raw)  # raw bytes after the header: the parent reads them in place
            res.send(("done",))
        except errors.VlbatchError as e:
            res.send(("error", e.error_type, str(e)))
        except Exception as e:  # a backend bug or native error text: still a typed, per-file error
            res.send(("error", "MediaError", f"decoder failed: {type(e).__name__}: {str(e)[:300]}"))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def main(argv: list[str]) -> None:
    import av
    import decord  # noqa: F401 - imported before "ready" so the first decode's time limit is all decoding

    import vlbatch.operators.media.decoders.decord_backend  # noqa: F401
    import vlbatch.operators.media.decoders.pyav_backend  # noqa: F401

    av.logging.set_level(av.logging.ERROR)  # keep FFmpeg's per-packet warnings out of worker logs
    res = Connection(int(argv[2]), readable=False)
    res.send(("ready",))
    _serve(Connection(int(argv[1]), writable=False), res)


if __name__ == "__main__":
    main(sys.argv)
