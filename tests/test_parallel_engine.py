"""The engine over a 2-rank tensor-parallel replica (gloo): identical greedy tokens to one
rank over the exactness cases (shared images, video, several media, text), with the prefix
cache on and off; MoE with expert parallel."""
from __future__ import annotations

import pytest
from parallel_support import run_ranks
from test_engine_support import image, request, video

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.factory import load_engine
from vlbatch.operators.parallel.replica import follow_pretrained

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUESTIONS = ["Describe the image.", "What colour dominates?", "Count the objects in the scene please."]
BUDGETS = [{"kv_budget_bytes": 16 << 20}, {"kv_budget_bytes": 16 << 20, "prefix_cache_bytes": 0,
                                           "vision_cache_bytes": 0, "chunk_size": 7}]


def _contents():
    out = [[("image", image(i, h, w)), q] for i, (h, w) in enumerate([(40, 56), (64, 48)]) for q in QUESTIONS]
    out += [[("video", video(0)), q] for q in ["What happens?", "Where is this?"]]
    out.append([("image", image(10)), "and", ("image", image(11, 48, 40)), "Which is brighter?"])
    out += ["Write a short caption number " + " ".join(["word"] * (i * 3)) + f" {i}." for i in range(3)]
    return [c if isinstance(c, list) else [c] for c in out]


def _generate(engine, reqs) -> dict:
    return {r.id: r.token_ids for r in engine.generate(reqs)}


def _rank(rank: int, world: int, cases: list) -> list:
    out = []
    for ckpt, ep, reqs, kw in cases:
        if rank == 0:
            engine = load_engine(ckpt, tensor_parallel_size=world, expert_parallel=ep, **kw)
            out.append((_generate(engine, reqs), engine.stats()))
            engine.close()
        else:
            out.append(follow_pretrained(ckpt, world, ep, **kw))
    return out


@pytest.mark.slow
def test_tp2_engine_equals_one_rank(tiny_ckpt):
    cases = []
    for variant, ep in (("dense", False), ("moe", True)):
        ckpt = tiny_ckpt(variant)
        reqs = [request(ckpt, f"r{i}", c, max_new_tokens=5 + i % 4) for i, c in enumerate(_contents())]
        cases += [(str(ckpt), ep, reqs, kw) for kw in BUDGETS]
    got = run_ranks(_rank, 2, cases)
    for i, (ckpt, _, reqs, kw) in enumerate(cases):
        want = _generate(load_engine(ckpt, **kw), reqs)
        tokens, stats = got[0][i]
        assert tokens == want, (ckpt, kw)
        assert got[1][i] > 0  # the follower ran the steps
        if kw.get("prefix_cache_bytes", 1):
            assert stats["prefix_hits"] > 0  # snapshots were restored on both ranks


def test_tensor_parallel_needs_a_process_group(tiny_ckpt):
    with pytest.raises(ConfigError, match="torch.distributed"):
        load_engine(tiny_ckpt("dense"), tensor_parallel_size=2)


def _rank_sized(rank: int, world: int, ckpt: str, reqs: list, kw: dict):
    if rank == 0:
        engine = load_engine(ckpt, tensor_parallel_size=world, **kw)
        out = (_generate(engine, reqs), engine.config)
        engine.close()
        return out
    return follow_pretrained(ckpt, world, **kw)


@pytest.mark.slow
def test_tp2_memory_fraction_sizes_every_rank_alike(tiny_ckpt):
    """The sizing runs on every rank (the tightest rank's figures; CPU ranks split the host's
    free memory) and the followers take rank 0's resolved budgets."""
    ckpt = tiny_ckpt("dense")
    reqs = [request(ckpt, f"r{i}", c, max_new_tokens=4) for i, c in enumerate(_contents()[:4])]
    kw = {"memory_fraction": 0.5, "kv_budget_bytes": 8 << 20, "max_num_seqs": 4}
    (tokens, config), steps = run_ranks(_rank_sized, 2, str(ckpt), reqs, kw)
    assert tokens == _generate(load_engine(ckpt, **kw), reqs)
    assert steps > 0
    one = load_engine(ckpt, **kw).config
    assert config.kv_budget_bytes == 8 << 20  # given: kept
    assert 0 < config.prefix_cache_bytes < 0.75 * one.prefix_cache_bytes  # sized from half the host's free memory
