"""A request in flight: its tokens, how many are computed, and the cache resources it holds.

`token_ids` is prompt + generated; positions [0, num_computed) have K/V in the blocks of
`block_table` and are folded into the DeltaNet states in `slot`. A step computes a
chunk [num_computed, num_computed + n); when the chunk reaches the last token the step
samples the next one. After preemption (recomputation) everything is released and the
sequence recomputes prompt + generated tokens from its prefix-cache hit.
"""
from __future__ import annotations

import enum
import time

import numpy as np
import torch

from vlbatch.operators.engine.request import Request


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, keys: np.ndarray, branch_points: tuple[int, ...],
                 generator: torch.Generator | None, arrival: float | None = None):
        self.request = request
        self.keys = keys  # [L] prefix-cache keys of the prompt
        self.planned = branch_points  # planned branch points (0 < p < L), sorted
        self.generator = generator
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.slot: int | None = None
        self.node = None  # locked prefix-cache node (hit) while running
        self.branches: list[int] = []  # branch points still ahead, ascending
        self.cached_tokens = 0
        self.preemptions = 0
        self.features: dict[int, torch.Tensor] = {}  # media index -> [N_vis, D] while prefilling
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.t_admitted: float | None = None
        self.t_first: float | None = None
        self.grammar = None  # a constrained request's `grammar.GrammarState` (set by the engine; rank 0 only)

    def wire_copy(self) -> Sequence:
        """A copy holding only what `ModelRunner.run` reads (request, token ids, block table,
        slot), for a tensor-parallel follower rank, which has no scheduler state."""
        out = Sequence(self.request, np.zeros(0, np.int64), (), None, arrival=self.arrival)
        out.token_ids, out.block_table, out.slot = list(self.token_ids), list(self.block_table), self.slot
        return out

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def remaining(self) -> int:
        """Tokens not yet computed (1 while decoding)."""
        return self.num_tokens - self.num_computed

    def next_branch(self) -> int | None:
        while self.branches and self.branches[0] <= self.num_computed:
            self.branches.pop(0)
        return self.branches[0] if self.branches else None
