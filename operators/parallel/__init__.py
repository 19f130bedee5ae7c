"""Tensor and expert parallelism as a transform of a finished model (gpt-fast style).

`plan.py` says which slice of each weight a rank holds (and refuses uneven splits),
`shard.py` swaps the layers that need a collective for their parallel twins, `comm.py`
is the tiny collective interface (a single-process no-op and torch.distributed),
`memory_plan.py` / `__main__.py` print per-rank memory for a config.json.
"""
from __future__ import annotations

import importlib

# name -> its module, imported on first use (PEP 562): `plan.py` needs no torch (`vlbatch validate`)
_EXPORTS = {"Comm": "comm", "SingleProcess": "comm", "TorchDistributed": "comm", "ParallelPlan": "plan"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
