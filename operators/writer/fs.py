"""One fsspec filesystem for local paths and s3:// (through s3fs).

`open_filesystem(uri, ...)` -> (filesystem, path without the protocol). Options mirror
the job config's `storage` section; credentials are never passed here, s3fs/botocore
read them from the environment (AWS_* variables, instance roles).
"""
from __future__ import annotations

import fsspec


def split_protocol(uri: str) -> tuple[str, str]:
    """'s3://b/k' -> ('s3', 'b/k'); '/a/b' -> ('file', '/a/b')."""
    if "://" in uri:
        proto, rest = uri.split("://", 1)
        return proto, rest
    return "file", uri


def open_filesystem(
    uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    anonymous: bool = False,
    retries: int = 5,
) -> tuple[fsspec.AbstractFileSystem, str]:
    proto, path = split_protocol(uri)
    if proto == "s3":
        client_kwargs = {}
        if endpoint_url:
            client_kwargs["endpoint_url"] = endpoint_url
        if region:
            client_kwargs["region_name"] = region
        fs = fsspec.filesystem(
            "s3",
            anon=anonymous,
            client_kwargs=client_kwargs,
            config_kwargs={"retries": {"max_attempts": max(1, retries), "mode": "standard"}},
            use_listings_cache=False,
            skip_instance_cache=True,
        )
        return fs, path.rstrip("/")
    if proto == "file":
        import os

        return fsspec.filesystem("file"), os.path.abspath(path)
    return fsspec.filesystem(proto), path.rstrip("/")


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])
