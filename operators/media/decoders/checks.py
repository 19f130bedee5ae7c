"""Whether each video decoder can run on this machine: `(here: Here) -> str | None`, one line
saying what to install (the `check` of each entry of `DECODERS`; imports only what it probes)."""
from __future__ import annotations

import importlib

from vlbatch.operators.registry import Here


def _installed(module: str, pip: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{module} is not installed ({e}): pip install {pip}"
    return None


def pyav(here: Here) -> str | None:
    return _installed("av", "av")


def decord(here: Here) -> str | None:
    return _installed("decord", "decord")


def torchcodec(here: Here) -> str | None:
    """TorchCodec needs FFmpeg's shared libraries on the system, not only the wheel."""
    from vlbatch.operators.media.decoders.torchcodec_backend import torchcodec_problem

    return torchcodec_problem()


def auto(here: Here) -> str | None:
    """auto needs one working decoder of `AUTO_ORDER`."""
    from vlbatch.operators.media.decoders import AUTO_ORDER, DECODERS

    if any(DECODERS.problem(name, here) is None for name in AUTO_ORDER):
        return None
    return "no working video decoder (pip install av)"
