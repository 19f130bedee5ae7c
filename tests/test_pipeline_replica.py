"""Tensor-parallel model replicas in the pipeline: the config keys, and the pipeline end to end
on a real local Ray (CPU bundles, gloo) giving the same rows with 2 ranks per replica as with 1."""
from __future__ import annotations

import json
import time

import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import validate_config

BASE = {"model": {"path": "ckpt"}, "input": {"uri": "in.jsonl"}, "output": {"uri": "out"}}


def _cfg(model: dict | None = None, **sections) -> dict:
    return {**BASE, "model": {**BASE["model"], **(model or {})}, **sections}


@pytest.mark.parametrize(("model", "sections", "field"), [
    ({"tensor_parallel_size": 0}, {}, "model.tensor_parallel_size"),
    ({"tensor_parallel_size": "two"}, {}, "model.tensor_parallel_size"),
    ({"expert_parallel": True}, {}, "expert_parallel needs tensor_parallel_size > 1"),
    ({"tensor_parallel_size": 2, "backend": "transformers"}, {}, "tensor_parallel_size > 1 needs backend=engine"),
    ({"tensor_parallel_size": 2}, {"resources": {"model": {"num_gpus": 0.5}}}, "resources.model.num_gpus"),
])
def test_parallel_config_errors_name_the_field(model, sections, field):
    with pytest.raises(ConfigError, match=field):
        validate_config(_cfg(model, **sections))


def test_parallel_config_keys_and_run_id():
    one = validate_config(_cfg())
    two = validate_config(_cfg({"tensor_parallel_size": 2, "expert_parallel": True},
                               resources={"model": {"num_gpus": 1}}))
    assert (one.model.tensor_parallel_size, one.model.expert_parallel) == (1, False)
    assert (two.model.tensor_parallel_size, two.model.expert_parallel) == (2, True)
    assert one.resolved_run_id() == two.resolved_run_id()  # how the model is split never changes the answers


def test_rank_0_actor_reserves_the_whole_replica():
    from vlbatch.pipeline.plan.spec import stage_specs

    def model_args(model: dict, gpus: float = 1.0, cpus: float = 2.0) -> dict:
        res = {"model": {"num_cpus": cpus, "memory_gb": 1, "num_gpus": gpus}}
        cfg = validate_config({**_cfg(model), "resources": res})
        return next(s for s in stage_specs(cfg, None) if s.name == "model").ray_args()

    assert model_args({}) == {"num_cpus": 2.0, "memory": 2**30, "num_gpus": 1.0}
    assert model_args({"tensor_parallel_size": 4}) == {"num_cpus": 8.0, "memory": 2**32, "num_gpus": 4.0}
    assert model_args({"tensor_parallel_size": 4}, gpus=0.0, cpus=0.5)["num_cpus"] == 2.0


def test_rank_0s_store_listens_on_loopback_when_the_ranks_share_a_node_else_on_the_nodes_address():
    """Issue 60 item 14: the store's port was opened on every interface (free_port bound ("", 0), and
    torch's TCPStore binds every interface for a port of its own)."""
    from vlbatch.pipeline.backends.followers import rendezvous_host

    assert rendezvous_host(["node-a"], "node-a", "10.0.0.5") == "127.0.0.1"
    assert rendezvous_host(["node-a", "node-a", "node-a"], "node-a", "10.0.0.5") == "127.0.0.1"
    assert rendezvous_host(["node-a", "node-b"], "node-a", "10.0.0.5") == "10.0.0.5"


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket process `pid` listens on (/proc: its socket inodes in net/tcp, tcp6)."""
    import ipaddress
    import os

    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.path.exists(f"/proc/{pid}/fd/{fd}") and os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    out = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                host, port = f[1].split(":")
                raw = b"".join(int(host[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(host), 8))
                out.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return out


def _follower_rank(port: int) -> None:
    import torch
    import torch.distributed as dist

    from vlbatch.pipeline.backends.followers import LOOPBACK, join_group, store_client

    join_group("gloo", store_client(LOOPBACK, port, 2), 1, 2)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.barrier()  # rank 0 has looked at its sockets
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_real_2_rank_group_joins_through_a_store_listening_on_loopback_only():
    """The product's rendezvous (`rendezvous_store`, `join_group`, `store_client`) with a follower in its own
    process: the group works, and while it is up rank 0's store port is open on 127.0.0.1 alone."""
    import multiprocessing
    import os

    import torch
    import torch.distributed as dist

    from vlbatch.pipeline.backends.followers import LOOPBACK, join_group, rendezvous_store

    store = rendezvous_store(LOOPBACK, 2)
    child = multiprocessing.get_context("spawn").Process(target=_follower_rank, args=(store.port,))
    child.start()
    try:
        join_group("gloo", store, 0, 2)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0
        assert [host for host, port in _listening(os.getpid()) if port == store.port] == ["127.0.0.1"]
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        child.join(timeout=120)  # a hang guard only
    assert child.exitcode == 0


def _job(root, ckpt: str, run: str, tp: int) -> dict:
    import numpy as np
    from PIL import Image

    media = []
    for i, (h, w) in enumerate([(64, 48), (40, 72), (56, 56)]):
        path = root / f"img{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
        media.append(str(path))
    (root / "broken.png").write_bytes(b"not a png")
    media.append(str(root / "broken.png"))
    man = root / "manifest.jsonl"
    man.write_text("".join(json.dumps({"media_uri": m}) + "\n" for m in media))
    return {
        "model": {"path": ckpt, "dtype": "float32", "device": "cpu", "tensor_parallel_size": tp,
                  "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 512, "kv_cache_mb": 16}},
        "input": {"uri": str(man), "format": "jsonl", "columns": {"media_type": None}},
        "task": {"mode": "questions", "questions": ["Describe.", "What colour dominates?"]},
        "sampling": {"max_tokens": 6},
        "image": {"max_pixels": 16384},
        "resources": {"preprocess": {"num_cpus": 0.5, "batch_size": 2, "max_actors": 1},
                      # 0.5: a 2-rank replica (2 x 0.5) + preprocess + write fit the session's 2 CPUs; one torch
                      # thread per rank either way (max(1, int(num_cpus)))
                      "model": {"num_cpus": 0.5, "batch_size": 2, "batch_visual_tokens": 256},
                      "write": {"num_cpus": 0.25, "batch_size": 4}},
        "output": {"uri": str(root / "out"), "run_id": run},
        "max_error_fraction": 1.0,
    }


def _rows(cfg: dict) -> list[tuple]:
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.operators.storage import StorageOptions

    sink = ParquetSink(f"{cfg['output']['uri']}/{cfg['output']['run_id']}", StorageOptions())
    keys = ("id", "media_uri", "prompt", "answer", "status", "error_type", "generated_tokens")
    return sorted(tuple(r[k] for k in keys) for r in sink.read().to_pylist())


@pytest.mark.slow
@pytest.mark.ray
def test_pipeline_with_2_rank_replicas_gives_the_rows_of_1_rank(ray_cluster, tiny_ckpt, tmp_path):
    import ray

    from vlbatch.pipeline.graph import run_job

    ckpt = str(tiny_ckpt("dense"))
    one, two = (_job(tmp_path, ckpt, f"tp{n}", n) for n in (1, 2))
    s1 = run_job(validate_config(one))
    s2 = run_job(validate_config(two))
    rows1, rows2 = _rows(one), _rows(two)
    assert len(rows1) == 8 and sum(r[4] == "ok" for r in rows1) == 6  # 3 images x 2 questions + 1 broken x 2
    assert all(r[3] is not None and r[6] >= 1 for r in rows1 if r[4] == "ok")
    assert rows2 == rows1
    assert s1.committed_by_status == s2.committed_by_status == {"ok": 6, "error": 2}
    cpus = ray.cluster_resources()["CPU"]  # the session's Ray: 2
    end = time.monotonic() + 60  # the replicas' actors (rank 0 and its followers) give every CPU back
    while time.monotonic() < end and ray.available_resources().get("CPU", 0) < cpus:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == cpus
