"""The parent's ends of one decoder child's two channels (`worker.DecodeWorker` starts the child over them).

Owns the transport under `vlbatch.operators.media.wire`: the request channel is a unix stream socket (the
child's end is its REQ_FD), so a request header carries the video's file with it as a descriptor
(SCM_RIGHTS): the child reads the file itself, and no media bytes ever cross the channel; the ring's
credit bytes follow on it during a decode. The reply channel is a pipe (the child's RES_FD). Every
read and write waits in `poll` at most until the call's deadline (`MediaTimeoutError` past it), never
in a blocking syscall; `heard` says whether a byte of the child's answer has arrived since `expect`.
"""
from __future__ import annotations

import array
import math
import os
import select
import socket
import time

from vlbatch.operators.errors import MediaTimeoutError
from vlbatch.operators.media import wire


class Channel:
    """A request socket and a reply pipe; `child_fds` (request, reply) are the child's ends until `started`."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s  # named in the timeout's message
        self._sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        res_r, res_w = os.pipe()
        self.child_fds = (child_sock.detach(), res_w)
        self._sock.setblocking(False)  # writes wait in poll, under the deadline, never in send()
        self._req, self._res = self._sock.fileno(), res_r
        self._poll_in, self._poll_out = select.poll(), select.poll()
        self._poll_in.register(res_r, select.POLLIN)
        self._poll_out.register(self._req, select.POLLOUT)
        self.heard = False

    def started(self) -> None:
        """The child holds its ends now: close ours of them."""
        for fd in self.child_fds:
            os.close(fd)
        self.child_fds = ()

    def close(self) -> None:
        if self.child_fds:  # the child never started
            self.started()
        self._sock.close()
        os.close(self._res)

    def expect(self) -> None:
        """A new call: nothing of its answer heard yet."""
        self.heard = False

    def send_request(self, request: bytes, fd: int, deadline: float) -> None:
        """One request header with the descriptor `fd` attached (the child gets its own copy of it)."""
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        while True:
            self._wait(self._poll_out, deadline)
            try:
                sent = self._sock.sendmsg([request], rights, socket.MSG_NOSIGNAL)
                break
            except BlockingIOError:
                continue  # the socket filled between poll and send
        self.write(memoryview(request)[sent:], deadline)  # the descriptor went with the first bytes

    def write(self, data: memoryview, deadline: float) -> None:
        """Write all of `data` to the request channel, waiting at most until `deadline`."""
        while data:
            self._wait(self._poll_out, deadline)
            try:
                data = data[os.write(self._req, data):]
            except BlockingIOError:
                continue  # the socket filled between poll and write

    def read_into(self, out: memoryview, deadline: float) -> None:
        """Read exactly `out.nbytes` raw bytes from the child straight into `out` (one copy, no framing)."""
        got = 0
        while got < out.nbytes:
            self._wait(self._poll_in, deadline)
            n = os.readv(self._res, [out[got:]])
            if n == 0:
                raise EOFError("the decoder process closed its pipe mid-message")
            got += n
            self.heard = True

    def read_header(self, deadline: float) -> dict:
        """One JSON header from the child, its length checked before the buffer is allocated."""
        prefix = bytearray(wire.LENGTH.size)
        self.read_into(memoryview(prefix), deadline)
        raw = bytearray(wire.header_length(bytes(prefix)))
        self.read_into(memoryview(raw), deadline)
        return wire.parse_header(raw)

    def _wait(self, poller: select.poll, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(math.ceil(left * 1000)):
            raise MediaTimeoutError(f"decoding took longer than the {self.timeout_s:g} s limit; the decoder was killed")
