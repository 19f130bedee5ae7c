"""Video decoding backends behind one interface (`base.VideoDecoder`).

`DECODERS` names them (the job config's `video.decoder` and its schema take their choices from
it; entry-point group `vlbatch.decoders` for out-of-tree ones); each target is a `VideoDecoder`
class called as `target(threads=n)`, each entry's check (`checks.py`) says what a missing one
needs. "auto" is the first of `AUTO_ORDER` that works here (`resolve_backend`). `get_decoder`
also takes "package.module:ClassName" for a backend defined elsewhere (tests use this to run a
deliberately hanging decoder inside the worker process). A new decoder: its module and one
`Entry` below.

`AUTO_ORDER` is the order of bench_video_decode's CPU seconds per sampled frame (benchmarks/RESULTS.md,
"issue 35"): fastest first. decord and PyAV are hard dependencies; TorchCodec needs FFmpeg's
shared libraries on the system (`backend_problem("torchcodec")` says what to install).
"""
from __future__ import annotations

import importlib

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.decoders.base import OpenVideo, ShortVideo, VideoData, VideoDecoder, VideoInfo
from vlbatch.operators.registry import Entry, Registry

_PKG = "vlbatch.operators.media.decoders"

DECODERS = Registry("video decoder", "video.decoder", "auto", (
    Entry("auto", f"{_PKG}:auto_decoder", "the fastest working one, in the order bench_video_decode measured "
          "(AUTO_ORDER: pyav, torchcodec, decord)", check=f"{_PKG}.checks:auto"),
    Entry("torchcodec", f"{_PKG}.torchcodec_backend:TorchcodecDecoder", "TorchCodec (needs FFmpeg's shared "
          "libraries)", check=f"{_PKG}.checks:torchcodec"),
    Entry("pyav", f"{_PKG}.pyav_backend:PyAVDecoder", "PyAV (FFmpeg bundled)", check=f"{_PKG}.checks:pyav"),
    Entry("decord", f"{_PKG}.decord_backend:DecordDecoder", "decord", check=f"{_PKG}.checks:decord"),
), group="vlbatch.decoders")
AUTO_ORDER = ("pyav", "torchcodec", "decord")


def backend_problem(name: str) -> str | None:
    """None if decoder `name` can decode on this machine, else one line saying what to install."""
    return DECODERS.problem(name)


def resolve_backend(name: str) -> str:
    """A concrete decoder name: `name` itself, or for "auto" the first of `AUTO_ORDER` that works here."""
    if name != "auto":
        return name
    for candidate in AUTO_ORDER:
        if backend_problem(candidate) is None:
            return candidate
    raise ConfigError("video.decoder: auto found no working video decoder (pip install av)")


def auto_decoder(threads: int = 1) -> VideoDecoder:
    return get_decoder(resolve_backend("auto"), threads)


def get_decoder(name: str = "auto", threads: int = 1) -> VideoDecoder:
    """A decoder instance by name (`DECODERS`, or "module:Class"); `ConfigError` for an unknown
    name, a broken plugin, or one that cannot run here."""
    if ":" in name:
        module, _, cls = name.partition(":")
        try:
            return getattr(importlib.import_module(module), cls)()
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"video backend {name!r} cannot be imported: {e}") from e
    name = resolve_backend(name)
    if why := backend_problem(name):
        raise ConfigError(f"video.decoder: {name} cannot run here: {why}")
    return DECODERS.load(name)(threads=threads)


__all__ = ["AUTO_ORDER", "DECODERS", "OpenVideo", "ShortVideo", "VideoData", "VideoDecoder", "VideoInfo",
           "backend_problem", "get_decoder", "resolve_backend"]
