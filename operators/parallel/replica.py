"""The engine over a tensor-parallel model replica: rank 0 schedules, every rank computes.

Rank 0 runs the whole `Engine` (`LeaderEngine`); before each model step it broadcasts the
step plan (`comm.broadcast_object`) and every other rank (`follow`) runs the same step
through its own `ModelRunner` over its shard: its KV pool holds its KV heads and its
`StatePool` its DeltaNet heads. Sampling happens on rank 0 only (the logits are
all-gathered inside the model, so every rank has them).

What a follower needs of a step is small: per chunk the token ids, positions, block
table, slot and the request (for its media: the replicated vision tower encodes it again
on each rank, through that rank's vision cache). The scheduler's state-pool operations
(zeroing an allocated slot, prefix-cache snapshots, restoring one, dropping one) are
recorded by `MirroredPool` on rank 0 and replayed, in order, before the step: each rank's
snapshots are of its own heads, keyed by an id rank 0 hands out.

Budgets: block tables and slots are broadcast as numbers, so every rank's pools must have
rank 0's sizes. `LeaderEngine` broadcasts its resolved `EngineConfig` once, before any
step, and `follow` builds its runner from that (a follower's own budget arguments only
matter for `memory_fraction`, whose sizing runs on every rank: `memory.budgets_from_memory`).
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlbatch.operators.engine.caches.block_manager import blocks_for_budget, kv_bytes_per_block
from vlbatch.operators.engine.caches.memory import budgets_from_memory
from vlbatch.operators.engine.caches.state_pool import Snapshot, StatePool
from vlbatch.operators.engine.caches.vision_cache import LRUVisionCache, NoVisionCache
from vlbatch.operators.engine.config import EngineConfig
from vlbatch.operators.engine.engine import Engine
from vlbatch.operators.engine.runner.model_runner import ModelRunner
from vlbatch.operators.engine.scheduling.scheduler import Chunk, StepPlan
from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.operators.model.loader import load_model, torch_dtype
from vlbatch.operators.parallel.comm import TorchDistributed
from vlbatch.operators.parallel.plan import ParallelPlan
from vlbatch.operators.parallel.shard import RankShard


@dataclass(frozen=True)
class PoolOp:
    """`kind`: zero (a fresh slot), snapshot (slot -> id), restore (id -> slot), drop (id)."""

    kind: str
    slot: int | None
    snap: int | None = None


class MirroredPool(StatePool):
    """A `StatePool` that logs what followers must repeat (`take_ops`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ops: list[PoolOp] = []
        self._ids: dict[int, int] = {}  # id(Snapshot) -> snapshot id
        self._next = itertools.count()

    def take_ops(self) -> list[PoolOp]:
        ops, self._ops = self._ops, []
        return ops

    def allocate(self) -> int:
        slot = super().allocate()
        self._ops.append(PoolOp("zero", slot))
        return slot

    def snapshot(self, slot: int) -> Snapshot:
        snap, sid = super().snapshot(slot), next(self._next)
        self._ids[id(snap)] = sid
        self._ops.append(PoolOp("snapshot", slot, sid))
        weakref.finalize(snap, self._dropped, id(snap), sid)
        return snap

    def restore(self, slot: int, snap: Snapshot) -> None:
        super().restore(slot, snap)
        self._ops.append(PoolOp("restore", slot, self._ids[id(snap)]))

    def _dropped(self, key: int, sid: int) -> None:
        self._ids.pop(key, None)
        self._ops.append(PoolOp("drop", None, sid))


class LeaderRunner(ModelRunner):
    """Rank 0's runner: broadcasts each step (pool ops + plan) before computing it."""

    pool_class = MirroredPool

    def __init__(self, model, num_blocks, block_size, num_slots, vision_cache, comm):
        super().__init__(model, num_blocks, block_size, num_slots, vision_cache)
        self.comm = comm

    def run(self, plan: StepPlan) -> torch.Tensor:
        self.comm.broadcast_object((self.pool.take_ops(), _wire_plan(plan)))
        return super().run(plan)


class LeaderEngine(Engine):
    """`Engine` on rank 0 of a tensor-parallel replica; `close()` releases the followers."""

    def __init__(self, model, tokenizer, eos_ids, config: EngineConfig, comm):
        comm.broadcast_object(config)  # the followers' pools take these sizes (`follow`)
        self.comm = comm
        super().__init__(model, tokenizer, eos_ids, config)

    def _runner(self, model, num_blocks: int, vcache) -> LeaderRunner:
        # the followers' runners use the default attention and no static decode: every rank must
        # run the same shapes through the collectives, so the leader does too
        return LeaderRunner(model, num_blocks, self.config.block_size, self.config.max_num_seqs, vcache, self.comm)

    def close(self) -> None:
        """Tell the followers to stop (call once, when done generating)."""
        self.comm.broadcast_object(None)


def _wire_plan(plan: StepPlan) -> StepPlan:
    chunks = [Chunk(c.seq.wire_copy(), c.start, c.end) for c in plan.chunks]
    return StepPlan(chunks, list(plan.copies))


def follow(model, comm) -> int:
    """A follower rank's loop: take rank 0's `EngineConfig`, then replay each broadcast step
    on this rank's shard until the leader's `close()`. -> the number of steps run."""
    config: EngineConfig = comm.broadcast_object(None)
    text = model.config.text
    elem = torch.empty(0, dtype=model.dtype).element_size()
    block_bytes = kv_bytes_per_block(config.block_size, len(text.full_layers), text.num_key_value_heads,
                                     text.head_dim, elem)
    vcache = LRUVisionCache(config.vision_cache_bytes) if config.vision_cache_bytes > 0 else NoVisionCache()
    runner = ModelRunner(model, blocks_for_budget(config.kv_budget_bytes, block_bytes), config.block_size,
                         config.max_num_seqs, vcache)
    snaps: dict[int, Snapshot] = {}
    steps = 0
    while (msg := comm.broadcast_object(None)) is not None:
        ops, plan = msg
        _replay(runner.pool, ops, snaps)
        try:
            runner.run(plan)
        except InputError:
            pass  # rank 0 fails the same step the same way and rolls it back
        steps += 1
    return steps


def _replay(pool: StatePool, ops: list[PoolOp], snaps: dict[int, Snapshot]) -> None:
    for op in ops:
        if op.kind == "zero":
            pool.conv[:, op.slot].zero_()
            pool.recurrent[:, op.slot].zero_()
        elif op.kind == "snapshot":
            snaps[op.snap] = pool.snapshot(op.slot)
        elif op.kind == "restore":
            pool.restore(op.slot, snaps[op.snap])
        else:
            snaps.pop(op.snap, None)


def load_rank(model_dir, tensor_parallel_size: int, expert_parallel: bool = False, *, leader: bool,
              **load_kw):
    """This process's shard over the initialised torch.distributed group -> (model, comm).
    ConfigError when the group is missing, of another size, or `leader` is not rank 0's role."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} needs an initialised torch.distributed "
                          "group (one process per rank)")
    comm = TorchDistributed()
    if comm.world != tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} but the process group has {comm.world} ranks")
    if leader != (comm.rank == 0):
        raise ConfigError(f"rank {comm.rank}: rank 0 runs the Engine, every other rank follow_pretrained")
    plan = ParallelPlan(tensor_parallel_size, comm.rank, expert_parallel)
    return load_model(model_dir, layout=RankShard(plan, comm), **load_kw), comm


def follow_pretrained(model_dir, tensor_parallel_size: int, expert_parallel: bool = False, *, device="cpu",
                      dtype=torch.float32, delta_rule: str = "auto", moe: str = "auto",
                      memory_fraction: float | None = None, **budgets) -> int:
    """A non-zero rank's side of `operators/factory.load_engine(..., tensor_parallel_size=N)`, with the
    same arguments: load this rank's shard, join the memory sizing when `memory_fraction` is
    set, then `follow` (with rank 0's budgets) until the leader closes."""
    model, comm = load_rank(model_dir, tensor_parallel_size, expert_parallel, leader=False, device=device,
                            dtype=torch_dtype(dtype), delta_rule=delta_rule, moe=moe)
    if memory_fraction is not None:  # its collectives need every rank; rank 0's result is broadcast
        budgets_from_memory(model, memory_fraction, budgets, comm)
    return follow(model, comm)
