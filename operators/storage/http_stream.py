"""`open_http(uri, storage)`: an http(s):// body as a stream (WebDataset shards, JSONL manifests), with
the time rules of `read_http` (http.py) that a long stream can keep.

- Opening: as `read_http`, retried `storage.max_attempts` times (429 / 5xx / connection errors,
  the headers deadline `http_total_timeout_s` enforced by `_Deadline` shutting the socket); then
  `StorageError`. 4xx, redirects elsewhere: permanent `MediaError`.
- The body: a `io.BufferedReader` over `_Body` (file semantics: `read(n)`, `readline`). Its bytes
  must come at `storage.http_min_bytes_per_s` or faster over each `http_rate_window_s` seconds
  *spent waiting on the server* (time the reader spends elsewhere, e.g. while its consumer or Ray
  holds a block back, is not counted: a paused reader is not a slow server). A watchdog thread per
  stream judges each window, so a read blocked on a trickle is ended too: it shuts the socket
  (`_Deadline.fire`) and the read raises. 0 = no minimum rate (then only `read_timeout_s` bounds
  each socket read).
- No whole-response deadline: a shard has no size bound that a deadline could be scaled by
  (no `max_bytes`; a Content-Length is often absent, and when present http.client already ends
  the body there), and the rate rule bounds the time anyway: a body of L bytes takes at most
  about L / http_min_bytes_per_s + one window of waiting, however long the shard is.
- Any failure of the body once it has started (the rate, a reset, a body shorter than its
  Content-Length, a read timeout) is a `StorageError` (transient) naming the URL: the body
  cannot be retried mid-stream, so the reader decides what it spoils (the WebDataset source:
  the sample being read, as an error row; pipeline/sources/webdataset.py).
"""
from __future__ import annotations

import http.client
import io
import threading
import time
import weakref

from vlbatch.operators.errors import StorageError
from vlbatch.operators.storage.http import _Deadline, _one_line, _open_once, _retrying, _Transient
from vlbatch.operators.storage.names import check_no_nul
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions


def open_http(uri: str, storage: StorageOptions = DEFAULT_STORAGE) -> io.BufferedReader:
    """A stream of the body at `uri` (module docstring); close it."""
    check_no_nul(uri)

    def once() -> io.BufferedReader:
        deadline = _Deadline(None, storage).__enter__()  # the headers' deadline only; the body: `_Body`
        try:
            resp = _open_once(uri, storage, deadline)
        except BaseException:
            deadline.__exit__(None, None, None)
            raise
        deadline.headers_in()
        if deadline.expired:  # the socket was shut mid-headers: http.client takes that as their end
            resp.close()
            deadline.__exit__(None, None, None)
            raise _Transient(deadline.why)
        return io.BufferedReader(_Body(resp, uri, storage, deadline))

    return _retrying(once, uri, storage)


class _Body(io.RawIOBase):
    """The response body, one socket read per `readinto` (`read1`), under the minimum rate: bytes
    and seconds spent inside reads are summed per window; the watchdog thread checks them every
    `http_rate_window_s` and fires `deadline` (shutting the socket) on a window below the rate."""

    def __init__(self, resp, uri: str, storage: StorageOptions, deadline: _Deadline):
        super().__init__()
        self._resp, self._uri, self._storage, self._deadline = resp, uri, storage, deadline
        self._lock = threading.Lock()
        self._bytes, self._waited_s = 0, 0.0  # of the current window
        self._reading_since: float | None = None  # when the read in progress began
        self._done = threading.Event()
        if storage.http_min_bytes_per_s > 0:  # the thread holds the body weakly: an unclosed one is still freed
            threading.Thread(target=_watch, args=(weakref.ref(self), self._done, storage.http_rate_window_s),
                             name="vlbatch-http-stream-rate", daemon=True).start()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        with self._lock:
            self._reading_since = time.monotonic()
        try:
            data = self._resp.read1(len(b))
        except (OSError, http.client.HTTPException) as e:
            raise self._failed(self._deadline.why if self._deadline.expired else f"{type(e).__name__}: {e}") from None
        finally:
            with self._lock:
                self._waited_s += time.monotonic() - self._reading_since
                self._reading_since = None
        if self._deadline.expired:  # a shut socket reads as an early end: never taken as the end
            raise self._failed(self._deadline.why)
        with self._lock:
            self._bytes += len(data)
        b[:len(data)] = data
        return len(data)

    def _failed(self, why: str | None) -> StorageError:
        return StorageError(f"reading {self._uri} failed mid-stream: {_one_line(why)}")

    def judge(self) -> bool:
        """One watchdog tick: a full window of waiting below the minimum rate fires the deadline
        (True: the stream is ended); a window not yet full goes on."""
        window, floor = self._storage.http_rate_window_s, self._storage.http_min_bytes_per_s
        with self._lock:
            now = time.monotonic()
            waited = self._waited_s + (0.0 if self._reading_since is None else now - self._reading_since)
            if waited < window:
                return False  # the reader was mostly elsewhere: not a full window of waiting yet
            rate = self._bytes / waited
            self._bytes, self._waited_s = 0, 0.0
            if self._reading_since is not None:
                self._reading_since = now
        if rate >= floor:
            return False
        self._deadline.fire(f"body at {rate:.0f} B/s over {window:g} s of waiting, under "
                            f"storage.http_min_bytes_per_s={floor:g}")
        return True

    def close(self) -> None:
        if not self.closed:
            self._done.set()
            self._deadline.__exit__(None, None, None)
            self._resp.close()
        super().close()


def _watch(body: weakref.ref, done: threading.Event, window_s: float) -> None:
    """The rate watchdog of one stream: `_Body.judge` every `window_s` until it ends the stream,
    the stream is closed, or it is gone."""
    while not done.wait(window_s):
        live = body()
        if live is None or live.judge():
            return
        del live  # no strong reference between ticks
