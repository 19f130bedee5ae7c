"""http(s):// media and shards, with the standard library (`urllib`), under the storage policy.

- `read_http(uri, storage, max_bytes=..., limiter=...)`: all bytes of one URL. Connection
  errors, timeouts, 429 and 5xx are transient: retried `storage.max_attempts` times in all
  with the policy's backoff (full jitter), a 429/503 `Retry-After` (seconds) honoured instead
  (capped at `RETRY_AFTER_MAX_S`); then `StorageError`. 404 / 403 / 410 and other 4xx are
  permanent: `MediaError` at once. `max_bytes` is enforced on `Content-Length` before the body
  and while streaming it (at most `max_bytes + 1` bytes are read): `InputError`.
  `storage.read_timeout_s` bounds each socket read *and* the whole body (a body trickling in
  slower than that is a timeout, not a hang). Redirects are followed to http(s):// only, at
  most `MAX_REDIRECTS` hops; a redirect elsewhere (ftp://, file://), a loop or too many hops
  is a permanent `MediaError` whose one-line message says so.
- `open_http(uri, storage)`: a streaming response (WebDataset shards over http), its opening
  retried as above.
- `HostLimiter(per_host)`: at most `per_host` requests in flight per host; one per actor (the
  decode stage owns it), shared by its threads.
"""
from __future__ import annotations

import random
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from urllib.parse import urlsplit

from vlbatch.operators.errors import InputError, MediaError, StorageError
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


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _open_once(uri: str, storage: StorageOptions):
    req = urllib.request.Request(uri, headers={"User-Agent": "vlbatch", "Accept-Encoding": "identity"})
    opener = urllib.request.build_opener(_Redirects)
    try:
        return opener.open(req, timeout=max(storage.connect_timeout_s, storage.read_timeout_s))
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
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
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


def _body(resp, uri: str, storage: StorageOptions, max_bytes: int | None, limit_name: str) -> bytes:
    length = resp.headers.get("Content-Length")
    if max_bytes is not None and length is not None and length.isdigit() and int(length) > max_bytes:
        raise InputError(f"{uri}: {length} bytes is over the {limit_name} limit of {max_bytes}")
    deadline = time.monotonic() + storage.read_timeout_s
    buf = bytearray()
    try:
        while True:
            chunk = resp.read(CHUNK)
            if not chunk:
                break
            buf += chunk
            if max_bytes is not None and len(buf) > max_bytes:
                raise InputError(f"{uri}: more than {max_bytes} bytes, over the {limit_name} limit of {max_bytes}")
            if time.monotonic() > deadline:
                raise _Transient(f"body slower than read_timeout_s={storage.read_timeout_s}")
    except (TimeoutError, ConnectionError, OSError) as e:
        raise _Transient(f"{type(e).__name__} reading the body: {e}") from None
    if length is not None and length.isdigit() and len(buf) != int(length):
        raise _Transient(f"body ended at {len(buf)} of {length} bytes")
    return bytes(buf)


def read_http(uri: str, storage: StorageOptions = DEFAULT_STORAGE, *, max_bytes: int | None = None,
              limit_name: str = "max_bytes", limiter: HostLimiter | None = None) -> bytes:
    """All bytes at `uri` (module docstring for errors and limits)."""
    def once() -> bytes:
        with (limiter.slot(uri) if limiter is not None else _nothing()):
            with _open_once(uri, storage) as resp:
                return _body(resp, uri, storage, max_bytes, limit_name)

    return _retrying(once, uri, storage)


def open_http(uri: str, storage: StorageOptions = DEFAULT_STORAGE):
    """A streaming response for `uri` (read it with `.read(n)`; close it)."""
    return _retrying(lambda: _open_once(uri, storage), uri, storage)


@contextmanager
def _nothing():
    yield
