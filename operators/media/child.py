"""The decoder child's side of the protocol (`vlbatch.operators.media.worker` starts it).

Owns the child's loop: read a request (`wire.decode_request`) and the video file's descriptor that
comes with it on the request socket (SCM_RIGHTS; never the video's bytes), run `decode_stream` over
the file (`storage.MediaFile`: read where it lies, `[0, size)`, closed after the request; a clips
request: `clip_decode.stream_clips`, clip by clip), and answer
on the reply pipe with JSON headers while the frames go into
the parent's shared-memory ring (`vlbatch.operators.media.ring`: a slot is written only with a
credit in hand, and every credit owed is taken before the next plan, "done" or "error"). It exits
when the parent closes the request socket (or dies). Started as
`python -m vlbatch.operators.media.worker REQ_FD RES_FD RING_FD`; imports its decoders before
saying "ready", so a video's time limit is all decoding.
"""
from __future__ import annotations

import array
import contextlib
import math
import os
import socket

import numpy as np

from vlbatch.operators import errors
from vlbatch.operators.errors import ConfigError, MediaError
from vlbatch.operators.media import ring, wire
from vlbatch.operators.media.video import Plan, decode_stream
from vlbatch.operators.storage.media_file import MediaFile

PRELOAD_ENV = "VLBATCH_DECODE_PRELOAD"  # the decoder the child imports before "ready" (torchcodec: torch)
# glibc malloc in the child (its environment, set by the parent): keep up to 64 MB of freed heap, and serve blocks
# under 32 MB from the heap. The defaults trim the heap's top after each frame's buffer is freed (a frame is the
# only thing above it in the child's small heap) and fault the same pages in again for the next one: 10 % of the
# child's CPU for PyAV at 1080p (issue 54). A frame of 4K RGB (24.9 MB) still comes from the heap.
CHILD_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(64 << 20), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def read_request(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """Child side: one request message from the parent and the descriptors that came with it (the
    caller closes them); None at end of input."""
    fds: list[int] = []
    prefix = _recv_exact(sock, wire.LENGTH.size, fds)
    raw = _recv_exact(sock, wire.LENGTH.unpack(prefix)[0], fds) if prefix is not None else None
    if raw is None:
        for fd in fds:
            os.close(fd)
        return None
    return raw, fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    """`n` bytes from `sock`, the descriptors of any SCM_RIGHTS message among them appended to `fds`."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k, ancillary, _flags, _addr = sock.recvmsg_into([view[got:]], socket.CMSG_SPACE(4 * array.array("i").itemsize),
                                                        socket.MSG_CMSG_CLOEXEC)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
        if k == 0:
            return None  # the parent closed the socket (or died)
        got += k
    return bytes(buf)


class _Sender:
    """Child side of one request: plans and frame headers on the reply pipe, frames into the ring
    (`vlbatch.operators.media.ring`: a slot is written only with a credit in hand)."""

    def __init__(self, req: int, res: int, frame_ring: ring.ChildRing):
        self.req, self.res, self.ring = req, res, frame_ring
        self.slots = 0  # 0: no ring in use (no plan yet, or plan_only)
        self.sent = self.credits = 0
        self.view: np.ndarray | None = None  # [slots, H, W, 3] over the ring, mapped after the first credit

    def plan(self, plan: Plan, plan_only: bool) -> None:
        self.open(wire.plan_header(plan), None if plan_only else plan.shape)

    def open(self, header: dict, shape: tuple[int, ...] | None) -> None:
        """Send a plan's (or a clip's) header; `shape` `(F, H, W, 3)`: its frames follow (None: none)."""
        self.drain()  # a second plan (the recount), the next clip: every frame before is copied out
        _write_all(self.res, wire.encode(header))
        if shape is not None:
            self.shape = tuple(shape[1:])
            self.slots = ring.ring_slots(math.prod(self.shape), shape[0])

    def frame(self, slot: int, frame: np.ndarray) -> None:
        if frame.shape != self.shape or frame.dtype != np.uint8:
            raise MediaError(f"the decoder made a frame of {frame.dtype} {list(frame.shape)}, planned "
                             f"uint8 {list(self.shape)}")
        while self.credits <= self.sent:
            self._take()
        if self.view is None:  # the parent grew the ring before its first credit
            self.view = self.ring.slots(self.slots, self.shape)
        np.copyto(self.view[self.sent % self.slots], frame)
        self.sent += 1
        _write_all(self.res, wire.encode({"kind": "frame", "slot": slot, "dtype": "uint8",
                                          "shape": list(frame.shape)}))

    def drain(self) -> None:
        """Take every credit still owed for this plan (`slots` + one per frame sent)."""
        while self.slots and self.credits < self.slots + self.sent:
            self._take()
        self.slots = self.sent = self.credits = 0
        self.view = None

    def _take(self) -> None:
        got = os.read(self.req, self.slots + self.sent - self.credits)  # blocks until the parent credits
        if not got:
            raise EOFError("the parent closed the request socket")
        self.credits += len(got)

    def finish(self, header: dict) -> None:
        self.drain()
        _write_all(self.res, wire.encode(header))


def _serve(req: int, res: int, ring_fd: int) -> None:
    """Child loop: one request at a time until the parent closes the request socket."""
    frame_ring = ring.ChildRing(ring_fd)
    sock = socket.socket(fileno=req)
    while True:
        got = read_request(sock)
        if got is None:
            return
        raw, fds = got
        for extra in fds[1:]:  # one file per request
            os.close(extra)
        request = wire.decode_request(raw)
        sender = _Sender(req, res, frame_ring)
        try:
            if not fds:
                raise MediaError("the decoder got no video file with its request")
            with MediaFile(fds[0], request.size) as data:
                if request.clips is not None:
                    _send_clips(sender, data, request)
                else:
                    _send_video(sender, data, request)
            sender.finish({"kind": "done"})
        except errors.VlbatchError as e:
            sender.finish(wire.error_header(e))
        except Exception as e:  # a backend bug or native error text: still a typed, per-file error
            sender.finish(wire.error_header(MediaError(f"decoder failed: {type(e).__name__}: {str(e)[:300]}")))


def _send_video(sender: _Sender, data: MediaFile, request: wire.Request) -> None:
    for item in decode_stream(data, request.sampling, request.backend, request.threads):
        if isinstance(item, Plan):
            sender.plan(item, request.plan_only)
            if request.plan_only:  # the first plan: the probe's (no frame decoded)
                break
        else:
            sender.frame(*item)


def _send_clips(sender: _Sender, data: MediaFile, request: wire.Request) -> None:
    """Each clip as it finishes: its header, then its sampled frames straight from the converter into the ring."""
    from vlbatch.operators.media.clip_decode import stream_clips
    from vlbatch.operators.media.decoders import DECODERS, get_decoder

    decoder = None  # clips decode with PyAV; a "module:Class" decoder only in tests (one that hangs or crashes)
    if request.backend != "pyav":
        if request.backend in DECODERS.entries_by_name() or ":" not in request.backend:
            raise ConfigError(f"video clips decode with PyAV, not {request.backend!r}")
        decoder = get_decoder(request.backend, request.threads)
    files = _ClipFileWriter(request.clip_files) if request.clip_files is not None else None
    for clip, sampled in stream_clips(data, request.clips, request.sampling, threads=request.threads,
                                      decoder=decoder, on_clip=files and files.write):
        header = {**wire.clip_header(clip, sampled), **(files.outcome.pop(clip.index, {}) if files else {})}
        if isinstance(sampled, errors.VlbatchError):
            sender.open(header, None)
            continue
        sender.open(header, sampled.shape)
        for slot, frame in enumerate(sampled.frames()):
            sender.frame(slot, frame)


class _ClipFileWriter:
    """`stream_clips`' hook in the child: each clip not in `files.skip` encoded (`clip_files.write_clip`)
    into the parent's local folder as `clip-<index>.<format>` (a temporary name until whole); `outcome`:
    clip index -> the "clip" header's file fields (`wire.parse_clip_file`)."""

    def __init__(self, files: wire.ClipFiles):
        from vlbatch.operators.media.clip_files import ClipTarget
        from vlbatch.operators.storage import StorageOptions

        self.target = ClipTarget(folder=files.folder, settings=files.settings, storage=StorageOptions())
        self.skip = frozenset(files.skip)
        self.outcome: dict[int, dict] = {}

    def write(self, clip, frames, stream, rotation: int = 0) -> None:
        from vlbatch.operators.media.clip_files import write_clip

        if clip.index in self.skip:
            return
        try:
            uri = write_clip(self.target, f"clip-{clip.index}", frames, stream, rotation)
            self.outcome[clip.index] = {"file": os.path.basename(uri)}
        except MediaError as e:  # the codec refused
            self.outcome[clip.index] = {"file_error": str(e)[:500]}
        except Exception as e:  # the local disk (StorageError, OSError)
            self.outcome[clip.index] = {"file_failed": f"{type(e).__name__}: {str(e)[:500]}"}


def _write_all(fd: int, data: bytes | memoryview) -> None:
    data = memoryview(data)
    while data:
        data = data[os.write(fd, data):]


def main(argv: list[str]) -> None:
    import av
    import decord  # noqa: F401 - imported before "ready" so the first decode's time limit is all decoding

    import vlbatch.operators.media.decoders.decord_backend  # noqa: F401
    import vlbatch.operators.media.decoders.pyav_backend  # noqa: F401
    from vlbatch.operators.media.decoders import DECODERS, resolve_backend

    preload = resolve_backend(os.environ.get(PRELOAD_ENV, "auto"))
    if preload == "torchcodec":  # torch + FFmpeg: ~3 s, before "ready"
        import torchcodec.decoders  # noqa: F401

        import vlbatch.operators.media.decoders.torchcodec_backend  # noqa: F401
    elif ":" not in preload and preload not in DECODERS.entries_by_name():  # a plugin's decoder: its module
        with contextlib.suppress(Exception):  # a broken one fails each decode with its ConfigError instead
            DECODERS.load(preload)

    av.logging.set_level(av.logging.ERROR)  # keep FFmpeg's per-packet warnings out of worker logs
    req, res, ring_fd = int(argv[1]), int(argv[2]), int(argv[3])
    _write_all(res, wire.encode({"kind": "ready"}))
    _serve(req, res, ring_fd)
