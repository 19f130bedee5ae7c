"""The per-rank memory command: counts from the meta-device shard, refusals, missing shapes."""
from __future__ import annotations

import torch

from vlbatch.operators.model.config import ModelConfig
from vlbatch.operators.parallel.__main__ import main
from vlbatch.operators.parallel.memory_plan import SHAPES, memory_plan


def test_9b_counts_match_the_seed_and_halve_per_rank():
    config = ModelConfig.from_dict(SHAPES["9b"][0])
    one = memory_plan(config, 1, dtype=torch.float32)
    assert one.weight_bytes == 9_409_813_744 * 4  # seed 000 section 17.3: text + LM head + vision
    assert one.kv_bytes_per_token == 2 * 8 * 4 * 256 * 4
    two = memory_plan(config, 2, dtype=torch.float32)
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert two.state_bytes_per_seq * 2 == one.state_bytes_per_seq
    vision = 456_010_480 * 4  # replicated on every rank
    norms = (32 * 2 * 4096 + 4096 + 8 * 2 * 256 + 24 * 128) * 4  # replicated text norms
    assert two.weight_bytes * 2 - vision - norms == one.weight_bytes
    assert two.max_batch(80 << 30, 8192) > one.max_batch(80 << 30, 8192)


def test_expert_parallel_splits_experts_and_command_says_what_is_missing(capsys):
    config = ModelConfig.from_dict(SHAPES["35b-a3b"][0])
    ep = memory_plan(config, 2, expert_parallel=True)
    tp = memory_plan(config, 2, expert_parallel=False)
    assert ep.weight_bytes == tp.weight_bytes  # same bytes, split by expert instead of width
    assert main(["--tp", "3", "--shape", "35b-a3b"]) == 0
    assert "refused" in capsys.readouterr().out
    assert main(["--tp", "2", "--expert-parallel"]) == 0
    out = capsys.readouterr().out
    assert "122b-a10b: shape not given" in out and "397b-a17b: shape not given" in out
    assert out.count("max batch") == 3
