"""Media bytes from local paths and object storage (`s3://`) through fsspec, with retries.

Owns: `StorageOptions` (where and how to reach storage) and `read_bytes`.

- Local paths (`/a/b.mp4`, `file:///a/b.mp4`) and `s3://bucket/key` go through one
  fsspec call (`cat_file`). `s3://` uses s3fs with the options' endpoint URL,
  region, profile and anonymous flag. Credentials are never part of the options:
  botocore finds them in the standard places (AWS_* environment variables, shared
  credentials / config files and profiles, instance metadata), and nothing here
  logs them (log lines carry the URI, the attempt and the error class only).
- Retries live here and only here: s3fs's and botocore's own retry loops are set
  to a single attempt, so the policy is visible and testable. Transient errors
  (connection refused/reset, timeouts, HTTP 5xx, SlowDown / throttling) are
  retried `max_attempts` times in all with exponential backoff and full jitter
  (`backoff_s * 2**attempt`, capped at `backoff_max_s`); after the last one
  `StorageError` (transient: resume retries the row) is raised.
- A missing object, a missing bucket or denied access are permanent: `MediaError`
  at once, no retry.
"""
from __future__ import annotations

import errno
import logging
import random
import time
from dataclasses import dataclass

from vlbatch.operators.errors import ConfigError, MediaError, StorageError

log = logging.getLogger(__name__)

_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"}
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.EPIPE, errno.EREMOTEIO, errno.ENETUNREACH, errno.EHOSTUNREACH}


@dataclass(frozen=True)
class StorageOptions:
    """How to reach object storage. No secrets here: credentials come from the AWS environment/profiles.

    endpoint_url: S3-compatible endpoint (MinIO, moto, a regional endpoint); None = AWS default.
    region: bucket region; anonymous: unsigned requests for public buckets; profile: a named
    AWS profile. max_attempts: tries in all for transient errors; backoff_s / backoff_max_s:
    exponential backoff base and cap; connect_timeout_s / read_timeout_s: per request.
    """

    endpoint_url: str | None = None
    region: str | None = None
    anonymous: bool = False
    profile: str | None = None
    max_attempts: int = 5
    backoff_s: float = 0.2
    backoff_max_s: float = 10.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"storage max_attempts must be at least 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ConfigError("storage backoff_s and backoff_max_s must not be negative")

    def fsspec_kwargs(self, protocol: str) -> dict:
        """Keyword arguments for `fsspec.filesystem(protocol, ...)`."""
        if protocol != "s3":
            return {}
        client: dict = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        kwargs: dict = {
            "anon": self.anonymous,
            "client_kwargs": client,
            # our loop is the only retry loop (see module docstring)
            "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"},
                              "connect_timeout": self.connect_timeout_s, "read_timeout": self.read_timeout_s},
        }
        if self.profile:
            kwargs["profile"] = self.profile
        return kwargs


DEFAULT_STORAGE = StorageOptions()  # AWS defaults, credentials from the environment


def filesystem(uri: str, storage: StorageOptions):
    """(fsspec filesystem, path inside it) for `uri`; `ConfigError` for an unsupported scheme."""
    import fsspec
    from fsspec.core import split_protocol

    protocol = split_protocol(uri)[0] or "file"
    if protocol not in ("file", "local", "s3", "s3a", "memory"):
        raise ConfigError(f"unsupported storage scheme {protocol!r} in {uri!r}: use a local path or s3://")
    protocol = "s3" if protocol == "s3a" else protocol
    fs = fsspec.filesystem(protocol, **storage.fsspec_kwargs(protocol))
    if protocol == "s3":
        fs.retries = 1  # s3fs's own loop off: one attempt per call, we retry
    return fs, fs._strip_protocol(uri)


def read_bytes(uri: str, storage: StorageOptions = DEFAULT_STORAGE) -> bytes:
    """All bytes of the object or file at `uri`.

    Raises `MediaError` (permanent: not found, denied, a directory) or `StorageError`
    (transient failures outlasted every attempt, or an unclassified storage failure).
    """
    fs, path = filesystem(uri, storage)
    for attempt in range(storage.max_attempts):
        try:
            return fs.cat_file(path)
        except Exception as e:  # noqa: BLE001 - classified below
            kind = classify(e)
            if kind == "permanent":
                raise MediaError(f"cannot read {uri}: {_describe(e)}") from e
            if kind == "unknown":
                raise StorageError(f"reading {uri} failed: {_describe(e)}") from e
            if attempt + 1 == storage.max_attempts:
                raise StorageError(f"reading {uri} failed after {storage.max_attempts} attempts: "
                                   f"{_describe(e)}") from e
            delay = random.uniform(0, min(storage.backoff_max_s, storage.backoff_s * 2**attempt))
            log.warning("transient storage error on %s (attempt %d/%d, %s); retrying in %.2f s",
                        uri, attempt + 1, storage.max_attempts, type(e).__name__, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


def classify(e: BaseException) -> str:
    """'permanent', 'transient' or 'unknown' for an exception from fsspec / s3fs / botocore / aiohttp."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in chain:
        if isinstance(x, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
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


def _describe(e: BaseException) -> str:
    text = str(e).replace("\n", " ")
    return f"{type(e).__name__}: {text[:300]}"
