"""Per-rank memory of a tensor / expert parallel replica, from a config.json on the meta device.

`memory_plan(config, plan, dtype)` builds rank 0's shard (`shard.ParallelModel`) on the meta
device (no memory) and counts: weight bytes (every parameter the rank holds, vision tower
replicated), KV bytes per token (full-attention layers, this rank's KV heads) and DeltaNet
state bytes per sequence (conv in the model dtype, recurrent in float32, this rank's heads).
`max_batch` is the most sequences of `context` tokens that fit beside the weights.

`SHAPES` are the sizes given in the architecture texts (seed 000: 9B, 35B-A3B; seed 004:
the 27B); a size the texts do not give is `None` and the command says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlbatch.operators.model.config import ModelConfig
from vlbatch.operators.parallel.comm import SingleProcess
from vlbatch.operators.parallel.plan import ParallelPlan

_ROPE = {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}
_VISION_9B = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304}
_DELTA = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def _shape(model_type: str, text: dict, vision: dict, tied: bool = False) -> dict:
    return {"model_type": model_type, "tie_word_embeddings": tied, "vision_config": vision,
            "text_config": {"vocab_size": 248320, "rope_parameters": _ROPE, "head_dim": 256, **_DELTA, **text}}


# name -> (config.json content or None, where the numbers come from)
SHAPES: dict[str, tuple[dict | None, str]] = {
    "9b": (_shape("qwen3_5", {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 12288,
                               "num_attention_heads": 16, "num_key_value_heads": 4},
                  {**_VISION_9B, "out_hidden_size": 4096}), "seed 000 section 1"),
    "27b": (_shape("qwen3_5", {"hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408,
                                "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48},
                   {**_VISION_9B, "out_hidden_size": 5120}),
            "seed 004 (text sizes; head_dim 256 from its 1.07 GB/layer KV at 262k); its vision tower is not "
            "given (only '~0.9B'): the 9B tower with out_hidden_size 5120 stands in"),
    "35b-a3b": (_shape("qwen3_5_moe", {"hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                                        "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
                       {**_VISION_9B, "out_hidden_size": 2048}),
                "seed 000 sections 1.3 and 14 (vocab and vision FFN width / heads as 9B's: not given separately)"),
    "122b-a10b": (None, "not given in seeds 000 / 004: pass --config with its config.json"),
    "397b-a17b": (None, "not given in seeds 000 / 004: pass --config with its config.json"),
}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one rank of a `tp`-way replica."""

    tp: int
    expert_parallel: bool
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int

    def max_batch(self, gpu_bytes: int, context: int, reserve_bytes: int = 0) -> int:
        """Sequences of `context` tokens whose KV + states fit beside the weights (0 when none)."""
        free = gpu_bytes - reserve_bytes - self.weight_bytes
        per_seq = self.state_bytes_per_seq + self.kv_bytes_per_token * context
        return max(0, free // per_seq)


def memory_plan(config: ModelConfig, tp: int, expert_parallel: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
    """Rank 0's bytes (the ranks are equal: every split is even, `ParallelPlan.check`)."""
    from vlbatch.operators.model.model import Qwen35Model
    from vlbatch.operators.parallel.shard import ParallelModel

    plan = ParallelPlan(tp, 0, expert_parallel)
    with torch.device("meta"):
        model = ParallelModel(config, plan, SingleProcess()) if tp > 1 else Qwen35Model(config)
    elem = torch.empty(0, dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    text = model.config.text
    kv = 2 * len(text.full_layers) * text.num_key_value_heads * text.head_dim * elem
    conv = text.linear_conv_dim * text.linear_conv_kernel_dim * elem
    rec = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    return MemoryPlan(tp, expert_parallel, weights, kv, len(text.linear_layers) * (conv + rec))
