"""The one retry policy of every storage call, and the classification it rests on.

`with_retries(fn, what=..., storage=...)` calls `fn()`; a *transient* failure (connection
refused/reset, timeouts, HTTP 5xx and 429, SlowDown / throttling) is retried `max_attempts`
times in all with exponential backoff and full jitter (`backoff_s * 2**attempt`, capped at
`backoff_max_s`); after the last attempt `StorageError` (transient: resume retries the row)
is raised. Anything else is raised unchanged at once: the caller decides what a permanent
failure (not found, denied) or an unclassified one means for it (media reads turn them into
`MediaError` / `StorageError`, see `io.read_bytes`).

Log lines carry `what` (a URI and an action), the attempt and the error class only, never
credentials.
"""
from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from vlbatch.operators.errors import StorageError
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"}
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.EPIPE, errno.EREMOTEIO, errno.ENETUNREACH, errno.EHOSTUNREACH}
# the path itself is wrong: a symlink loop, a name too long, a socket or a device without a driver
_PERMANENT_ERRNOS = {errno.ELOOP, errno.ENAMETOOLONG, errno.ENXIO, errno.ENODEV, errno.ENOENT, errno.EACCES,
                     errno.EPERM, errno.EISDIR, errno.ENOTDIR}


def with_retries(fn: Callable[[], T], *, what: str, storage: StorageOptions = DEFAULT_STORAGE) -> T:
    """`fn()` under the retry policy (module docstring); `StorageError` when transient failures outlast it."""
    for attempt in range(storage.max_attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below; non-transient ones re-raised as they are
            if classify(e) != "transient":
                raise
            if attempt + 1 == storage.max_attempts:
                raise StorageError(f"{what} failed after {storage.max_attempts} attempts: {describe(e)}") from e
            delay = random.uniform(0, min(storage.backoff_max_s, storage.backoff_s * 2**attempt))
            log.warning("%s: transient storage error (attempt %d/%d, %s); retrying in %.2f s",
                        what, attempt + 1, storage.max_attempts, type(e).__name__, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


def classify(e: BaseException) -> str:
    """'permanent', 'transient' or 'unknown' for an exception from fsspec / s3fs / botocore / aiohttp.
    A name the OS refuses (`ValueError: embedded null byte`) is permanent: no retry can fix it."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in chain:
        if isinstance(x, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return "permanent"
        if isinstance(x, ValueError) and "null byte" in str(x):  # the OS's "embedded null byte": a bad name
            return "permanent"
        if type(x) is OSError and x.errno in _PERMANENT_ERRNOS:
            return "permanent"
    for x in chain:
        if _is_transient(x):
            return "transient"
    return "unknown"


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return True
    name = type(e).__name__
    module = type(e).__module__ or ""
    if module.startswith("botocore") and ("Connection" in name or "Timeout" in name or name == "HTTPClientError"):
        return True
    if module.startswith("aiohttp") and ("Connect" in name or "Disconnected" in name or "Payload" in name):
        return True
    return name in ("FSTimeoutError", "IncompleteRead", "ResponseParserError")


def describe(e: BaseException) -> str:
    """'Type: message' on one line, at most ~300 characters of message."""
    text = str(e).replace("\n", " ")
    return f"{type(e).__name__}: {text[:300]}"
