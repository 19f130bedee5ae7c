"""Video decoding backends behind one interface (`base.VideoDecoder`).

`get_decoder(name)` returns a backend: "torchcodec", "pyav", "decord", "auto" (the first of
`AUTO_ORDER` that works here: `resolve_backend`), or "package.module:ClassName" for a backend
defined elsewhere (tests use this to run a deliberately hanging decoder inside the worker process).

`AUTO_ORDER` is the order of bench_video_decode's CPU seconds per sampled frame (benchmarks/RESULTS.md,
"issue 35"): fastest first. decord and PyAV are hard dependencies; TorchCodec needs FFmpeg's
shared libraries on the system (`backend_problem("torchcodec")` says what to install).
"""
from __future__ import annotations

import importlib

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.decoders.base import OpenVideo, ShortVideo, VideoDecoder, VideoInfo

BACKENDS = ("auto", "torchcodec", "pyav", "decord")
AUTO_ORDER = ("pyav", "torchcodec", "decord")


def backend_problem(name: str) -> str | None:
    """None if backend `name` can decode on this machine, else one line saying what to install."""
    if name == "torchcodec":
        from vlbatch.operators.media.decoders.torchcodec_backend import torchcodec_problem

        return torchcodec_problem()
    if name in ("pyav", "decord"):
        try:
            importlib.import_module("av" if name == "pyav" else "decord")
        except ImportError as e:
            return f"{name} is not installed ({e}): pip install {'av' if name == 'pyav' else 'decord'}"
    return None


def resolve_backend(name: str) -> str:
    """A concrete backend name: `name` itself, or for "auto" the first of `AUTO_ORDER` that works here."""
    if name != "auto":
        return name
    for candidate in AUTO_ORDER:
        if backend_problem(candidate) is None:
            return candidate
    raise ConfigError("video.decoder: auto found no working video decoder (pip install av)")


def get_decoder(name: str = "auto", threads: int = 1) -> VideoDecoder:
    """A decoder instance by name; raises `ConfigError` for an unknown name."""
    name = resolve_backend(name)
    if name == "decord":
        from vlbatch.operators.media.decoders.decord_backend import DecordDecoder

        return DecordDecoder(threads=threads)
    if name == "pyav":
        from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder

        return PyAVDecoder(threads=threads)
    if name == "torchcodec":
        if why := backend_problem("torchcodec"):
            raise ConfigError(f"video.decoder: torchcodec cannot run here: {why}")
        from vlbatch.operators.media.decoders.torchcodec_backend import TorchcodecDecoder

        return TorchcodecDecoder(threads=threads)
    if ":" in name:
        module, _, cls = name.partition(":")
        try:
            return getattr(importlib.import_module(module), cls)()
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"video backend {name!r} cannot be imported: {e}") from e
    raise ConfigError(f"unknown video backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["AUTO_ORDER", "BACKENDS", "OpenVideo", "ShortVideo", "VideoDecoder", "VideoInfo", "backend_problem",
           "get_decoder", "resolve_backend"]
