"""The collectives a sharded model and the engine driver need, behind one small contract.

`SingleProcess` is the no-op (rank 0 of 1: every collective returns its input);
`TorchDistributed` wraps an initialised `torch.distributed` process group (gloo on the
CPU, NCCL on CUDA). Sums are in the tensor's dtype, in rank order as the backend does them.
"""
from __future__ import annotations

from typing import Any

import torch


class Comm:
    """Contract: `rank` in 0..world-1; `all_reduce(x)` -> the elementwise sum over ranks
    (a new tensor or `x` updated in place, same shape); `all_gather(x, dim)` -> the ranks'
    tensors (equal shapes) concatenated along `dim` in rank order; `broadcast_object(obj)`
    -> rank 0's picklable `obj` on every rank (others pass None)."""

    rank: int = 0
    world: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def broadcast_object(self, obj: Any) -> Any:
        raise NotImplementedError


class SingleProcess(Comm):
    """One rank: every collective is the identity."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class TorchDistributed(Comm):
    """Over the default (or a given) initialised torch.distributed group."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
