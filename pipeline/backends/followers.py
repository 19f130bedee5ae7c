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

Rendezvous: rank 0 holds the group's store (torch's TCPStore) on a socket it binds itself, on
loopback when every rank is on its node (always, as placed above) and on the node's address only
when one is not (`rendezvous_host`), never on all interfaces (the store binds every interface when
it opens its own port); the port is taken by that bind, so no other process can take it first. All
N ranks join one torch.distributed group through it (`join_group`), gloo on the CPU, NCCL on CUDA.
Rank 0 runs the scheduler (`load_engine(..., tensor_parallel_size=N)`: a `LeaderEngine`) and broadcasts
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


LOOPBACK = "127.0.0.1"


def rendezvous_host(rank_nodes: list[str], here: str, node_ip: str) -> str:
    """Where rank 0's store listens: loopback when every rank's node (`rank_nodes`, Ray node ids) is `here`
    (rank 0's), else this node's address `node_ip`, which the other nodes' ranks can reach."""
    return LOOPBACK if all(n == here for n in rank_nodes) else node_ip


def rendezvous_store(host: str, world: int):
    """Rank 0's store: a TCPStore serving on a socket listening on `host` alone, at a free port (`.port`)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, port, world, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store owns (and closes) the socket


def join_group(backend: str, store, rank: int, world: int) -> None:
    """Join the replica's group through `store` (rank 0's own; a follower's: a client of `host`:`port`)."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def store_client(host: str, port: int, world: int):
    """A follower's client of rank 0's store."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world, False, timeout=COLLECTIVE_TIMEOUT)


class Follower:
    """Rank i > 0 of a replica (a Ray actor in bundle i): join the group, load this rank's
    shard, replay rank 0's steps until it closes. `run` -> the number of steps run."""

    def __init__(self, num_threads: int, visible_gpus: str | None):
        if visible_gpus is not None:  # before CUDA starts in this process: this rank's GPUs only
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
        import torch

        torch.set_num_threads(num_threads)

    def run(self, host: str, port: int, rank: int, world: int, backend: str, model_dir: str, expert_parallel: bool,
            engine_kw: dict) -> int:
        import torch.distributed as dist

        from vlbatch.operators.parallel.replica import follow_pretrained

        join_group(backend, store_client(host, port, world), rank, world)
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

        from vlbatch.operators.factory import load_engine

        n, ep = cfg.model.tensor_parallel_size, cfg.model.expert_parallel
        self.engine = None
        self.followers: list = []
        self.runs: list = []
        self.store = None
        backend = "nccl" if str(engine_kw.get("device", "cpu")).startswith("cuda") else "gloo"
        node = ray.get_runtime_context().get_node_id()  # every follower is pinned to it (`follower_actor`)
        host = rendezvous_host([node] * (n - 1), node, ray.util.get_node_ip_address())
        threads = max(1, int(cfg.resources.model.num_cpus))
        try:
            self.store = rendezvous_store(host, n)
            gpus = rank_gpus(n)
            for rank in range(1, n):
                actor = follower_actor(node).remote(threads, gpus[rank])
                self.followers.append(actor)
                self.runs.append(actor.run.remote(host, self.store.port, rank, n, backend, model_dir, ep, engine_kw))
            join_group(backend, self.store, 0, n)
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
        self.store = None  # its socket closes with it


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


def follower_actor(node: str):
    """The `Follower` actor class for `node` (rank 0's): no resources of its own (rank 0's
    reservation covers the replica), never placed on another node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(Follower).options(num_cpus=0, num_gpus=0,
                                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
