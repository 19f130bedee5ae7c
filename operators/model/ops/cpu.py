"""Where the compiled CPU forms of the model ops apply."""
from __future__ import annotations

import torch


def cpu_float32(*tensors: torch.Tensor) -> bool:
    """Every tensor on the CPU in float32 (any strides: the compiled ops read numpy views). Asked
    per layer and step: a plain loop (`all` over a generator and `.device.type` cost ~4x more)."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True
