"""A stand-in for a compromised decoder child (tests only), started the way `DecodeWorker` starts the real one.

    python tests/hostile_decoder.py MODE MARKER REQ_FD RES_FD RING_FD

It says ready (except in "pickle-ready", which sends a pickle instead), then answers every request with the reply of MODE, until the
parent closes the request socket. Mode "record" answers as "ok" and first writes to MARKER (JSON) what the
request brought: its bytes, the bytes waiting behind it, the descriptors, and the sha256 of the file's
checked `[0, size)` (`tests/test_media_handoff.py`). Pickle payloads reduce to `open(MARKER, "w")`: if the parent ever
unpickled one, MARKER would exist.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import sys
from multiprocessing.connection import Connection

from vlbatch.operators.media import wire
from vlbatch.operators.media.child import _write_all, read_request


class Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plan(shape, indices) -> bytes:
    return wire.encode({"kind": "plan", "dtype": "uint8", "shape": shape, "source_fps": 10.0,
                        "total_frames": 4, "indices": indices})


def reply(mode: str, marker: str) -> bytes:
    frame = wire.encode({"kind": "frame", "slot": 0, "dtype": "uint8", "shape": [2, 2, 3]})  # pixels: the ring
    return {
        "pickle-header": wire.message(pickle.dumps(Evil(marker))),  # a pickle where the JSON header goes
        "huge-length": wire.LENGTH.pack(10**12),  # a header claiming 10^12 bytes
        "huge-plan": plan([4, 250_000, 333_334, 3], [0, 1, 2, 3]),  # frames claiming 1.0e12 bytes
        "huge-frame": plan([1, 2, 2, 3], [0]) + wire.encode(
            {"kind": "frame", "slot": 0, "dtype": "uint8", "shape": [250_000, 1_333_334, 3]}),
        "bad-json": wire.message(b'{"kind": "plan", "shape": [1, 2'),
        "not-an-object": wire.message(b"[1, 2, 3]"),
        "done-early": plan([2, 2, 2, 3], [0, 1]) + frame + wire.encode({"kind": "done"}),
        "float-dtype": plan([1, 2, 2, 3], [0]) + wire.encode(
            {"kind": "frame", "slot": 0, "dtype": "float64", "shape": [2, 2, 3]}),
        "ok": plan([1, 2, 2, 3], [0]) + frame + wire.encode({"kind": "done"}),
        "record": plan([1, 2, 2, 3], [0]) + frame + wire.encode({"kind": "done"}),
        "error-InputError": wire.encode({"kind": "error", "type": "InputError", "message": "sampled too much"}),
        "error-EngineError": wire.encode({"kind": "error", "type": "EngineError", "message": "not mine"}),
        "clip-repeat": 2 * wire.encode({"kind": "clip", "index": 0, "start": 0, "end": 10, "fps": 10.0,
                                        "source": "fixed", "error": {"type": "InputError", "message": "too big"}}),
        "clip-file": wire.encode({"kind": "clip", "index": 0, "start": 0, "end": 10, "fps": 10.0, "source": "fixed",
                                  "error": {"type": "InputError", "message": "too big"}, "file": marker}),  # MARKER: a name
        "error-dunder": wire.encode({"kind": "error", "type": "__class__", "message": "not a class"}),
    }[mode]


def _read_exact(fd: int, n: int) -> None:
    """Take `n` bytes (the ring's credits) from the request socket."""
    while n:
        got = os.read(fd, n)
        if not got:
            return
        n -= len(got)


def record(marker: str, request: bytes, fds: list[int], sock: socket.socket) -> None:
    """What one request brought, as JSON in `marker` (read back by the test)."""
    size = json.loads(request)["size"]
    try:
        behind = len(sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        behind = 0
    digests = [hashlib.sha256(os.pread(fd, size, 0)).hexdigest() for fd in fds]
    with open(marker, "w") as f:
        json.dump({"request_bytes": wire.LENGTH.size + len(request), "behind": behind, "size": size,
                   "sha256": digests}, f)


def send_pickle(res: int, obj) -> None:
    """What the old protocol's parent unpickled: `Connection.send` framing (on a dup: Connection closes its fd)."""
    Connection(os.dup(res), readable=False).send(obj)


def main(mode: str, marker: str, req: int, res: int) -> None:
    if mode == "pickle-ready":
        send_pickle(res, Evil(marker))  # instead of the ready header
    else:
        _write_all(res, wire.encode({"kind": "ready"}))
    sock = socket.socket(fileno=req)
    while True:
        got = read_request(sock)
        if got is None:
            return
        request, fds = got
        if mode == "record":
            record(marker, request, fds, sock)
        for fd in fds:  # the video's file: a hostile child has no use for it
            os.close(fd)
        json.loads(request)  # a real request
        if mode in ("pickle-ready", "pickle-reply"):
            send_pickle(res, ("plan", Evil(marker)))
        else:
            _write_all(res, reply(mode, marker))
            if mode in ("ok", "record"):  # the ring's credits (one slot, one frame): 2 bytes, taken so the pipe stays in step
                _read_exact(req, 2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
