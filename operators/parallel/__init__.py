"""Tensor and expert parallelism as a transform of a finished model (gpt-fast style).

`plan.py` says which slice of each weight a rank holds (and refuses uneven splits),
`shard.py` swaps the layers that need a collective for their parallel twins, `comm.py`
is the tiny collective interface (a single-process no-op and torch.distributed),
`memory_plan.py` / `__main__.py` print per-rank memory for a config.json.
"""
from vlbatch.operators.parallel.comm import Comm, SingleProcess, TorchDistributed
from vlbatch.operators.parallel.plan import ParallelPlan

__all__ = ["Comm", "ParallelPlan", "SingleProcess", "TorchDistributed"]
