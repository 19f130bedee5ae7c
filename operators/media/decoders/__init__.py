"""Video decoding backends behind one interface (`base.VideoDecoder`).

`get_decoder(name)` returns a backend: "decord" (default), "pyav", or
"package.module:ClassName" for a backend defined elsewhere (tests use this to run
a deliberately hanging decoder inside the worker process).
"""
from __future__ import annotations

import importlib

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.decoders.base import OpenVideo, ShortVideo, VideoDecoder, VideoInfo

BACKENDS = ("decord", "pyav")


def get_decoder(name: str = "decord", threads: int = 1) -> VideoDecoder:
    """A decoder instance by name; raises `ConfigError` for an unknown name."""
    if name == "decord":
        from vlbatch.operators.media.decoders.decord_backend import DecordDecoder

        return DecordDecoder(threads=threads)
    if name == "pyav":
        from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder

        return PyAVDecoder(threads=threads)
    if ":" in name:
        module, _, cls = name.partition(":")
        try:
            return getattr(importlib.import_module(module), cls)()
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"video backend {name!r} cannot be imported: {e}") from e
    raise ConfigError(f"unknown video backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "OpenVideo", "ShortVideo", "VideoDecoder", "VideoInfo", "get_decoder"]
