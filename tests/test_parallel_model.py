"""Tensor / expert parallel shards (TP=2 on gloo) against the one-process model: fp32 logits
within 1e-4 through prefill and decode, per-rank slices only, uneven splits refused."""
from __future__ import annotations

import pytest
import torch
from parallel_support import run_ranks

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model import load_model
from vlbatch.operators.model.config import ModelConfig
from vlbatch.operators.model.contiguous_cache import ContiguousCache
from vlbatch.operators.parallel import ParallelPlan, SingleProcess, TorchDistributed
from vlbatch.operators.parallel.shard import RankShard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = torch.tensor([[3, 17, 250, 9, 41, 5, 77], [12, 8, 8, 300, 2, 64, 150]])


def _run(model) -> list[torch.Tensor]:
    """Prefill [2, 7] then three greedy decode steps -> the logits of every call."""
    cache = ContiguousCache(model.config.text, 2, device="cpu", dtype=torch.float32, capacity=16)
    out = [model(PROMPTS, cache=cache)]
    for _ in range(3):
        out.append(model(out[-1][:, -1:].argmax(-1), cache=cache))
    return out


CASES = [("dense", False), ("dense_tied", False), ("moe", True), ("moe", False)]


def _rank(rank: int, world: int, cases: list[tuple[str, bool]]) -> list[dict]:
    comm = TorchDistributed()
    out = []
    for ckpt, expert_parallel in cases:
        model = load_model(ckpt, layout=RankShard(ParallelPlan(world, rank, expert_parallel), comm))
        out.append({"logits": _run(model), "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}})
    return out


@pytest.fixture(scope="module")
def tp2(tiny_ckpt):
    """Every case run once on two gloo ranks (one spawn)."""
    ranks = run_ranks(_rank, 2, [(str(tiny_ckpt(v)), ep) for v, ep in CASES])
    return {case: [r[i] for r in ranks] for i, case in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize("variant,ep", CASES)
def test_tp2_logits_equal_one_rank(tiny_ckpt, tp2, variant, ep):
    ckpt = tiny_ckpt(variant)
    want = _run(load_model(ckpt))
    ranks = tp2[(variant, ep)]
    for got in ranks:
        for w, g in zip(want, got["logits"], strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    full = {n: tuple(p.shape) for n, p in load_model(ckpt).named_parameters()}
    shapes = ranks[0]["shapes"]
    text = ModelConfig.from_pretrained(ckpt).text
    assert shapes["language_model.embed_tokens.weight"][0] == text.vocab_size // 2
    q = "language_model.layers.3.self_attn.q_proj.weight"
    assert shapes[q][0] == full[q][0] // 2
    if variant == "moe":
        gu = "language_model.layers.0.mlp.experts.gate_up_proj"
        assert shapes[gu] == ((4, *full[gu][1:]) if ep else (8, full[gu][1] // 2, full[gu][2]))


@pytest.mark.parametrize("variant,ep,names", [("dense_uneven", False, ["num_key_value_heads=1",
                                                                      "linear_num_value_heads=3"]),
                                               ("moe_uneven", True, ["num_experts=3"])])
def test_uneven_splits_are_refused(tiny_ckpt, variant, ep, names):
    config = ModelConfig.from_pretrained(tiny_ckpt(variant))
    with pytest.raises(ConfigError) as err:
        ParallelPlan(2, 0, ep).check(config)
    for name in names:
        assert name in str(err.value)
    ParallelPlan(1, 0, ep).check(config)  # one rank takes anything
    with pytest.raises(ConfigError):
        load_model(tiny_ckpt(variant), layout=RankShard(ParallelPlan(2, 0, ep), SingleProcess()))


def test_plan_slices_are_disjoint_and_cover():
    from vlbatch.devtools.checkpoints.tiny import tiny_config_dict

    text = ModelConfig.from_dict(tiny_config_dict("dense")).text
    parts = [ParallelPlan(2, r).shard("language_model.layers.0.linear_attn.in_proj_qkv.weight",
                                      (text.linear_conv_dim, 64), text) for r in range(2)]
    rows = sorted(i for p in parts for a, b in p.ranges for i in range(a, b))
    assert rows == list(range(text.linear_conv_dim))
    k = text.linear_key_dim
    assert parts[1].ranges[1] == (k + k // 2, 2 * k)  # rank 1's key heads
