"""http(s):// media and shards, with the standard library (`urllib`), under the storage policy.

- `read_http(uri, storage, max_bytes=..., limiter=...)`: all bytes of one URL. Connection
  errors, timeouts, 429 and 5xx are transient: retried `storage.max_attempts` times in all
  with the policy's backoff (full jitter), a 429/503 `Retry-After` (seconds) honoured instead
  (capped at `RETRY_AFTER_MAX_S`); then `StorageError`. 404 / 403 / 410 and other 4xx are
  permanent: `MediaError` at once. `max_bytes` is enforced on `Content-Length` before the body
  and while streaming it (at most `max_bytes + 1` bytes are read): `InputError`.
  Time: `storage.read_timeout_s` bounds each socket read; a response whose bytes trickle in
  more often than that never trips it, so two more rules end it (then the attempt is transient, retried, and
  `StorageError` after the last: the medium's row, the batch goes on):
  * the headers must arrive within `http_total_timeout_s`, and the whole response within
    `response_deadline_s` = max(http_total_timeout_s, max_bytes / http_min_bytes_per_s): a body
    of max_bytes at the minimum rate always fits. `_Deadline` is a timer that shuts the
    response's sockets down when time is up, so a read blocked on a header line or a body
    chunk returns at once;
  * the body must arrive at `http_min_bytes_per_s` (0: no minimum) or faster over each window of
    `http_rate_window_s` seconds counted from the body's start (tumbling windows, checked as
    each read returns: the body is read with `read1`, one socket read at a time).
  A NUL byte or another character no URL may hold is an `InputError` (permanent), before any
  request. Redirects are followed to http(s):// only, at
  most `MAX_REDIRECTS` hops; a redirect elsewhere (ftp://, file://), a loop or too many hops
  is a permanent `MediaError` whose one-line message says so.
- `open_http` (a streaming body: WebDataset shards, JSONL manifests) lives in `http_stream.py`:
  the same opening and headers deadline, a minimum rate over windows of waiting, no whole-response
  deadline (its docstring says why).
- `HostLimiter(per_host)`: at most `per_host` requests in flight per host; one per actor (the
  decode stage owns it), shared by its threads.
"""
from __future__ import annotations

import http.client
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from urllib.parse import urlsplit

from vlbatch.operators.errors import InputError, MediaError, StorageError
from vlbatch.operators.storage.names import check_no_nul, printable
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions

HTTP_PROTOCOLS = ("http", "https")
RETRY_AFTER_MAX_S = 120.0
CHUNK = 1 << 20
PERMANENT_STATUS = frozenset({400, 401, 403, 404, 405, 410, 414, 451})
MAX_REDIRECTS = 5  # hops followed per request, each to http(s):// only


def is_http(uri: str) -> bool:
    return uri.split("://", 1)[0].lower() in HTTP_PROTOCOLS if "://" in uri else False


class HostLimiter:
    """At most `per_host` concurrent requests per host (a semaphore per host, made on first use)."""

    def __init__(self, per_host: int):
        if per_host < 1:
            raise ValueError(f"per_host must be at least 1, got {per_host}")
        self.per_host = per_host
        self._lock = threading.Lock()
        self._slots: dict[str, threading.BoundedSemaphore] = {}

    @contextmanager
    def slot(self, uri: str):
        host = urlsplit(uri).netloc.lower()
        with self._lock:
            sem = self._slots.setdefault(host, threading.BoundedSemaphore(self.per_host))
        with sem:
            yield


class _Transient(Exception):
    """A retryable HTTP failure; `retry_after` in seconds when the server said so."""

    def __init__(self, msg: str, retry_after: float | None = None):
        super().__init__(msg)
        self.retry_after = retry_after


def _retry_after(headers) -> float | None:
    raw = headers.get("Retry-After") if headers is not None else None
    try:
        return min(RETRY_AFTER_MAX_S, max(0.0, float(raw))) if raw is not None else None
    except ValueError:
        return None  # an HTTP date: use our backoff


class _RedirectRefused(Exception):
    """A redirect we do not follow (another scheme): permanent."""


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handling, to http(s) only (its default also follows ftp://), at most
    `MAX_REDIRECTS` hops and the same URL twice at most (a loop ends at once)."""

    max_redirections = MAX_REDIRECTS
    max_repeats = 1

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlsplit(newurl).scheme.lower() not in HTTP_PROTOCOLS:
            fp.close()
            raise _RedirectRefused(f"redirected (HTTP {code}) to {_one_line(newurl)[:200]}: only http(s) "
                                   "redirects are followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def response_deadline_s(storage: StorageOptions, max_bytes: int | None) -> float:
    """Seconds a whole response may take: max(http_total_timeout_s, max_bytes / http_min_bytes_per_s);
    http_total_timeout_s alone without a max_bytes or a minimum rate (module docstring)."""
    if max_bytes is None or storage.http_min_bytes_per_s <= 0:
        return storage.http_total_timeout_s
    return max(storage.http_total_timeout_s, max_bytes / storage.http_min_bytes_per_s)


class _Deadline:
    """One response's deadline: a timer thread that shuts down every socket the response opened
    (`watch`, from `_Watched*Connection.connect`) when time is up; `expired` / `why` say it did.
    Two steps: the headers within `head_s` (`http_total_timeout_s`: never scaled, a header is
    small), then the whole response within `seconds` of the start (None: no whole-response
    deadline, a stream's: `http_stream.py`, whose rate watchdog calls `fire`). A read blocked on a
    shut socket returns at once (an error, or an early end of data: the reader checks `expired`
    after every read)."""

    def __init__(self, seconds: float | None, storage: StorageOptions):
        total = storage.http_total_timeout_s
        self.seconds, self.head_s = seconds, total if seconds is None else min(seconds, total)
        self.expired, self.why = False, None
        self._total = storage.http_total_timeout_s
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._headers_in = self._closed = False
        self._timer = self._arm(self.head_s, self._at_head)

    def _arm(self, seconds: float, then) -> threading.Timer:
        timer = threading.Timer(seconds, then)
        timer.daemon = True
        return timer

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closed = True
            self._timer.cancel()

    def headers_in(self) -> None:
        with self._lock:
            self._headers_in = True

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
            late = self.expired
        if late:
            _shut(sock)

    def _at_head(self) -> None:
        with self._lock:
            if self.seconds is None and (self._closed or self._headers_in):
                return  # a stream: no whole-response deadline
            rest = (self.seconds or 0.0) - (time.monotonic() - self._start)
            if self._closed or (self._headers_in and rest > 0):
                if not self._closed:  # the headers came in time: the body's turn
                    self._timer = self._arm(rest, self._fire)
                    self._timer.start()
                return
        self._fire(f"no response headers within {self.head_s:g} s (storage.http_total_timeout_s={self._total:g})")

    def fire(self, why: str) -> None:
        """Time is up for another reason (`why`): the sockets are shut as at the deadline."""
        self._fire(why)

    def _fire(self, why: str | None = None) -> None:
        with self._lock:
            self.why = why or (f"no whole response within {self.seconds:g} s (storage.http_total_timeout_s="
                               f"{self._total:g}, scaled by max_bytes / http_min_bytes_per_s)")
            self.expired = True  # after `why`: a reader that sees it expired finds the reason
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: nothing blocks on it


class _Watched:
    """A connection class mixin: its socket (the TLS one for https) goes under `deadline` once connected."""

    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self):
        super().connect()
        self._deadline.watch(self.sock)


class _WatchedHTTPConnection(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPSConnection(_Watched, http.client.HTTPSConnection):
    pass


class _WatchedHTTP(urllib.request.HTTPHandler):
    """urllib's http handler, each connection's socket under `deadline` (redirect hops too)."""

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req):
        return self.do_open(_WatchedHTTPConnection, req, deadline=self._deadline)


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def https_open(self, req):
        return self.do_open(_WatchedHTTPSConnection, req, context=self._context, deadline=self._deadline)


class _Rate:
    """The minimum body rate (module docstring): `add(n)` after each read -> the rate of a window
    that ended below `min_per_s`, else None."""

    def __init__(self, min_per_s: float, window_s: float):
        self.min_per_s, self.window_s = min_per_s, window_s
        self.start, self.bytes = time.monotonic(), 0

    def add(self, n: int) -> float | None:
        self.bytes += n
        now = time.monotonic()
        span = now - self.start
        if self.min_per_s <= 0 or span < self.window_s:
            return None
        rate = self.bytes / span
        self.start, self.bytes = now, 0
        return rate if rate < self.min_per_s else None


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _open_once(uri: str, storage: StorageOptions, deadline: _Deadline | None = None):
    try:
        req = urllib.request.Request(uri, headers={"User-Agent": "vlbatch", "Accept-Encoding": "identity"})
    except ValueError as e:  # not a URL at all
        raise InputError(f"{printable(uri)}: not a valid URL ({e})") from None
    watched = () if deadline is None else (_WatchedHTTP(deadline), _WatchedHTTPS(deadline))
    opener = urllib.request.build_opener(_Redirects, *watched)
    try:
        return opener.open(req, timeout=max(storage.connect_timeout_s, storage.read_timeout_s))
    except http.client.InvalidURL as e:  # a control character in the URL: bad input, never retried
        raise InputError(f"{printable(uri)}: not a valid URL ({e})") from None
    except _RedirectRefused as e:
        raise MediaError(f"cannot read {uri}: {e}") from None
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 429 or e.code >= 500:
            raise _Transient(f"HTTP {e.code}", _retry_after(e.headers)) from None
        if 300 <= e.code < 400:  # urllib's own refusals: a loop, too many hops, a file:// target
            reason = _one_line(e.reason)
            if "Redirection to url" not in reason:
                reason = f"too many redirects or a redirect loop (at most {MAX_REDIRECTS} hops are followed)"
            raise MediaError(f"cannot read {uri}: HTTP {e.code} redirect refused: {reason}") from None
        raise MediaError(f"cannot read {uri}: HTTP {e.code} {_one_line(e.reason)}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
        if deadline is not None and deadline.expired:
            raise _Transient(deadline.why) from None
        raise _Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None


def _retrying(fn, uri: str, storage: StorageOptions):
    for attempt in range(storage.max_attempts):
        try:
            return fn()
        except _Transient as e:
            if attempt + 1 == storage.max_attempts:
                raise StorageError(f"reading {uri} failed after {storage.max_attempts} attempts: {e}") from None
            delay = e.retry_after
            if delay is None:
                delay = random.uniform(0, min(storage.backoff_max_s, storage.backoff_s * 2**attempt))
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


def _body(resp, uri: str, storage: StorageOptions, max_bytes: int | None, limit_name: str,
          deadline: _Deadline) -> bytes:
    length = resp.headers.get("Content-Length")
    if max_bytes is not None and length is not None and length.isdigit() and int(length) > max_bytes:
        raise InputError(f"{uri}: {length} bytes is over the {limit_name} limit of {max_bytes}")
    rate = _Rate(storage.http_min_bytes_per_s, storage.http_rate_window_s)
    buf = bytearray()
    try:
        while True:
            chunk = resp.read1(CHUNK)  # one socket read: the checks below run as a trickle arrives
            if deadline.expired:  # a shut socket reads as an early end: never a short body taken whole
                raise _Transient(deadline.why)
            if not chunk:
                break
            buf += chunk
            if max_bytes is not None and len(buf) > max_bytes:
                raise InputError(f"{uri}: more than {max_bytes} bytes, over the {limit_name} limit of {max_bytes}")
            if (slow := rate.add(len(chunk))) is not None:
                raise _Transient(f"body at {slow:.0f} B/s over {storage.http_rate_window_s:g} s, under "
                                 f"storage.http_min_bytes_per_s={storage.http_min_bytes_per_s:g}")
    except (TimeoutError, ConnectionError, OSError, http.client.HTTPException) as e:
        raise _Transient(deadline.why if deadline.expired else f"{type(e).__name__} reading the body: {e}") from None
    if length is not None and length.isdigit() and len(buf) != int(length):
        raise _Transient(f"body ended at {len(buf)} of {length} bytes")
    return bytes(buf)


def read_http(uri: str, storage: StorageOptions = DEFAULT_STORAGE, *, max_bytes: int | None = None,
              limit_name: str = "max_bytes", limiter: HostLimiter | None = None) -> bytes:
    """All bytes at `uri` (module docstring for errors, limits and the deadline)."""
    check_no_nul(uri)

    def once() -> bytes:
        with (limiter.slot(uri) if limiter is not None else _nothing()):
            with _Deadline(response_deadline_s(storage, max_bytes), storage) as deadline:
                with _open_once(uri, storage, deadline) as resp:
                    deadline.headers_in()
                    return _body(resp, uri, storage, max_bytes, limit_name, deadline)

    return _retrying(once, uri, storage)


@contextmanager
def _nothing():
    yield
