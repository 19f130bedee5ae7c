"""`auto`, the default attention choice: by the device the caches live on."""
from __future__ import annotations

import torch

from vlbatch.operators.kernels.attention import select_attention
from vlbatch.operators.kernels.attention.base import PagedAttention


def auto(device) -> PagedAttention:
    """`cpu` (the numba paged decode) on the CPU, else `sdpa`."""
    return select_attention("cpu" if torch.device(device).type == "cpu" else "sdpa", device)
