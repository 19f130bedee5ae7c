"""Where and how to reach storage: `StorageOptions` and one fsspec filesystem per URI.

Local paths (`/a/b.mp4`, relative paths, `file:///a/b.mp4`) and `s3://bucket/key` (`s3a://`
too) are supported; `memory://` for tests (never for output: `OUTPUT_PROTOCOLS`); `http(s)://` URLs are
read by `storage.http` (urllib, no listing: `filesystem` gives fsspec's HTTP filesystem only for
completeness). `s3://` uses s3fs with the options' endpoint URL, region, profile and anonymous flag.
Credentials are never part of the options: botocore finds them in the standard places (AWS_*
environment variables, shared credentials / config files and profiles, instance metadata), and
nothing here logs them.

s3fs's and botocore's own retry loops are set to a single attempt, so the one retry loop is
`vlbatch.operators.storage.retry.with_retries` (visible and testable). The listings cache is
off: a sink lists what it just committed, and must see it.
"""
from __future__ import annotations

from dataclasses import dataclass

from vlbatch.operators.errors import ConfigError

SUPPORTED_PROTOCOLS = ("file", "local", "s3", "s3a", "memory", "http", "https")  # http(s): storage/http.py
# Where a run's output may go: the persistent filesystems of SUPPORTED_PROTOCOLS that a sink can
# write (local paths, file://, s3:// and s3a://). Not memory:// (gone when the writer's process
# exits: a run would report success and keep nothing), not http(s):// (read-only here).
OUTPUT_PROTOCOLS = ("file", "local", "s3", "s3a")


@dataclass(frozen=True)
class StorageOptions:
    """How to reach object storage. No secrets here: credentials come from the AWS environment/profiles.

    endpoint_url: S3-compatible endpoint (MinIO, moto, a regional endpoint); None = AWS default.
    region: bucket region; anonymous: unsigned requests for public buckets; profile: a named
    AWS profile. max_attempts: tries in all for transient errors; backoff_s / backoff_max_s:
    exponential backoff base and cap; connect_timeout_s / read_timeout_s: per request (read: per
    socket read). http(s) only (`storage/http.py`): http_total_timeout_s, the whole response's
    deadline (scaled up by max_bytes: `http.response_deadline_s`); http_min_bytes_per_s (0: none)
    over each http_rate_window_s of a body.
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
    http_total_timeout_s: float = 300.0
    http_min_bytes_per_s: float = 65536.0
    http_rate_window_s: float = 30.0

    @classmethod
    def of(cls, section) -> StorageOptions:
        """From the job config's `storage` section (`pipeline/config/storage.StorageSection`): `retries` + 1
        attempts in all. Made once per start by the preflight (`RunPlan.run.storage`)."""
        return cls(endpoint_url=section.endpoint_url, region=section.region, anonymous=section.anonymous,
                   max_attempts=section.retries + 1, http_total_timeout_s=section.http_total_timeout_s,
                   http_min_bytes_per_s=section.http_min_bytes_per_s)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"storage max_attempts must be at least 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ConfigError("storage backoff_s and backoff_max_s must not be negative")
        if self.http_total_timeout_s <= 0 or self.http_rate_window_s <= 0 or self.http_min_bytes_per_s < 0:
            raise ConfigError("storage http_total_timeout_s and http_rate_window_s must be positive, "
                              "http_min_bytes_per_s not negative")

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
            "use_listings_cache": False,
        }
        if self.profile:
            kwargs["profile"] = self.profile
        return kwargs


DEFAULT_STORAGE = StorageOptions()  # AWS defaults, credentials from the environment


def is_local(uri: str) -> bool:
    """A path on this machine: no scheme, or file://."""
    return "://" not in uri or uri.startswith("file://")


def protocol_of(uri: str) -> str:
    """'s3://b/k' -> 's3'; '/a/b' and 'a/b' -> 'file'."""
    from fsspec.core import split_protocol

    return split_protocol(uri)[0] or "file"


def output_uri_problem(uri: str) -> str | None:
    """None when a run's output may go to `uri` (`OUTPUT_PROTOCOLS`); else a message naming output.uri."""
    protocol = protocol_of(uri)
    if protocol in OUTPUT_PROTOCOLS:
        return None
    return (f"output.uri: {protocol}:// ({uri[:200]!r}) is not a persistent filesystem vlbatch writes; use a local "
            "folder, file:// or s3://")


def persistent_output_uri(uri: str) -> str:
    """The job config's `output.uri` validator: `uri`, else `ValueError` (pydantic names the field)."""
    why = output_uri_problem(uri)
    if why is not None:
        raise ValueError(why.removeprefix("output.uri: "))
    return uri


def check_output_uri(uri: str) -> None:
    """`ConfigError` when a run's output may not go to `uri` (`output_uri_problem`)."""
    if (why := output_uri_problem(uri)) is not None:
        raise ConfigError(why)


def filesystem(uri: str, storage: StorageOptions = DEFAULT_STORAGE):
    """(fsspec filesystem, path inside it) for `uri`; `ConfigError` for an unsupported scheme.

    The path has no protocol and no trailing slash; local paths are absolute.
    """
    import fsspec

    protocol = protocol_of(uri)
    if protocol not in SUPPORTED_PROTOCOLS:
        raise ConfigError(f"unsupported storage scheme {protocol!r} in {uri!r}: use a local path, s3:// or http(s)://")
    protocol = "s3" if protocol == "s3a" else protocol
    fs = fsspec.filesystem(protocol, **storage.fsspec_kwargs(protocol))
    if protocol == "s3":
        fs.retries = 1  # s3fs's own loop off: one attempt per call, we retry
    return fs, fs._strip_protocol(uri)


def with_protocol(uri_like: str, path: str) -> str:
    """`path` (as `filesystem` returns it) back as a URI of the same scheme as `uri_like`."""
    protocol = protocol_of(uri_like)
    if protocol in ("file", "local") or "://" in path:  # http(s): fsspec's paths keep their scheme
        return path
    return f"{protocol}://{path}"


def join(root: str, *parts: str) -> str:
    """'/'-join for paths and URIs alike ('s3://b/x' + 'y' -> 's3://b/x/y')."""
    return "/".join([root.rstrip("/"), *parts])
