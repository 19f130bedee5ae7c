"""A model replica of N ranks on Ray (`model.tensor_parallel_size` = N > 1).

Placement. The N ranks of a replica share one node (their collectives run over loopback
or NVLink) and their resources are reserved all at once (placing rank 0 first and asking
for its followers' GPUs later deadlocks when two half-placed replicas each hold a GPU the
other waits for). Both come from one Ray resource request: the model actor of the Ray Data
pool (rank 0) asks for the whole replica, N * (`resources.model.num_cpus`, `num_gpus`,
`memory_gb`) (`plan/spec.Pool`: `ranks`), and one actor's resources always lie on one node, as
a STRICT_PACK placement group's bundles would. Rank 0's `Followers` starts the N-1 `Follower`
actors with zero resources, pinned to its node (`NodeAffinitySchedulingStrategy`, hard), and
hands rank i its slice of the actor's GPU ids, which the follower makes its only visible
devices before CUDA starts (rank 0 keeps all of them and computes on the first). So on every
rank the model's device is the first visible GPU; on the CPU (the tests) the ranks share
the actor's CPU reservation. Ray Data's accounting is exact (one actor = one replica), and
`resources.model.min_actors` / `max_actors` count replicas.

Why not a placement group per replica: Ray Data can only create it in the driver (the
pool's `ray_remote_args_fn`), so its lifetime is the driver's, not the actor's, and a model
actor ends without running its UDF's teardown (seen with Ray 2.60: the group stayed
CREATED after the pool released the actor), so every replica the pool retires (autoscaling
down, the end of a job on a long-lived driver) would keep its N bundles reserved.

Rendezvous: rank 0's node IP and a free port there (`tcp://`); all N ranks join one
torch.distributed group, gloo on the CPU, NCCL on CUDA. Rank 0 runs the scheduler
(`load_engine(..., tensor_parallel_size=N)`: a `LeaderEngine`) and broadcasts
each step's plan; each follower runs `follow_pretrained` with the same arguments (its
budgets are rank 0's, broadcast: `operators/parallel/replica.py`).

Lifetime: the followers are owned by rank 0 and die with it (Ray kills the actors an actor
created when it exits, however it exits). `close()` (the model stage's teardown, and rank
0's failure to build its engine) ends the followers' loop and kills them.
"""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import JobConfig

log = logging.getLogger("vlbatch.pipeline")

# How long a rank waits in a collective: a follower waits for rank 0's next step for as long
# as the model stage idles (start-up, a slow upstream), so far beyond torch's 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(hours=12)
CLOSE_WAIT_S = 60.0  # for the followers to leave their loop after rank 0's close


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Follower:
    """Rank i > 0 of a replica (a Ray actor in bundle i): join the group, load this rank's
    shard, replay rank 0's steps until it closes. `run` -> the number of steps run."""

    def __init__(self, num_threads: int, visible_gpus: str | None):
        if visible_gpus is not None:  # before CUDA starts in this process: this rank's GPUs only
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
        import torch

        torch.set_num_threads(num_threads)

    def run(self, address: str, rank: int, world: int, backend: str, model_dir: str, expert_parallel: bool,
            engine_kw: dict) -> int:
        import torch.distributed as dist

        from vlbatch.operators.parallel.replica import follow_pretrained

        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        try:
            return follow_pretrained(model_dir, world, expert_parallel, **engine_kw)
        finally:
            dist.destroy_process_group()


class Followers:
    """Rank 0's side: starts the followers on this actor's node, joins them and builds the
    `LeaderEngine` (`engine`). `model_dir`: the checkpoint on this node (the followers share the
    node, so its download too); `engine_kw`: the `load_engine` keywords (device,
    dtype, budgets), the same on every rank."""

    def __init__(self, cfg: JobConfig, model_dir: str, engine_kw: dict):
        import ray
        import torch.distributed as dist

        from vlbatch.operators.factory import load_engine

        n, ep = cfg.model.tensor_parallel_size, cfg.model.expert_parallel
        self.engine = None
        self.followers: list = []
        self.runs: list = []
        backend = "nccl" if str(engine_kw.get("device", "cpu")).startswith("cuda") else "gloo"
        address = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        threads = max(1, int(cfg.resources.model.num_cpus))
        try:
            gpus = rank_gpus(n)
            for rank in range(1, n):
                actor = follower_actor().remote(threads, gpus[rank])
                self.followers.append(actor)
                self.runs.append(actor.run.remote(address, rank, n, backend, model_dir, ep, engine_kw))
            dist.init_process_group(backend, init_method=address, rank=0, world_size=n, timeout=COLLECTIVE_TIMEOUT)
            self.engine = load_engine(model_dir, tensor_parallel_size=n, expert_parallel=ep,
                                                 **engine_kw)
        except BaseException:
            self.close()  # the actor's error is what Ray Data reports
            raise

    def close(self) -> None:
        """Release the followers (their loop ends, then they are killed) and leave the group."""
        import ray
        import torch.distributed as dist

        if self.engine is not None:
            engine, self.engine = self.engine, None
            try:
                engine.close()
                ray.get(self.runs, timeout=CLOSE_WAIT_S)
            except Exception as e:  # noqa: BLE001 - teardown: the followers are killed below anyway
                log.warning("a tensor-parallel follower did not stop cleanly: %s: %s", type(e).__name__, e)
        for actor in self.followers:
            ray.kill(actor)
        self.followers, self.runs = [], []
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_gpus(n: int) -> list[str | None]:
    """Each rank's CUDA_VISIBLE_DEVICES from this actor's GPU ids (an equal slice each, in
    order); all None when the actor holds no GPU. ConfigError when they do not split N ways."""
    import ray

    ids = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    if not ids:
        return [None] * n
    if len(ids) % n:
        raise ConfigError(f"model.tensor_parallel_size={n}: the model actor holds {len(ids)} GPUs, not a multiple")
    k = len(ids) // n
    return [",".join(ids[i * k:(i + 1) * k]) for i in range(n)]


def follower_actor():
    """The `Follower` actor class for this actor's node: no resources of its own (rank 0's
    reservation covers the replica), never placed on another node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return ray.remote(Follower).options(num_cpus=0, num_gpus=0,
                                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
