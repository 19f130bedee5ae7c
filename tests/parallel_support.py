"""Run a function on N gloo ranks (spawned processes on loopback) and collect rank 0's result."""
from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args: tuple, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> list:
    """`fn(rank, world, *args)` on `world` processes joined with gloo -> their results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, free_port(), fn, args, out), nprocs=world, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
