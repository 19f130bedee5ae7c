"""Model structure from config.json alone: the seed's 9B parameter count, config parsing rules."""
from __future__ import annotations

import pytest
import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model import ModelConfig, Qwen35Model

# Qwen3.5-9B as listed in seed 000 section 1.2 (config.json spelling).
CONFIG_9B = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "num_heads": 16,
        "intermediate_size": 4304,
        "out_hidden_size": 4096,
        "num_position_embeddings": 2304,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    },
}


def test_9b_parameter_count_on_meta_device():
    config = ModelConfig.from_dict(CONFIG_9B)
    assert config.text.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert len(config.text.full_layers) == 8 and len(config.text.linear_layers) == 24
    with torch.device("meta"):
        model = Qwen35Model(config)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.visual.parameters())
    assert vision == 456_010_480
    assert total == 9_409_813_744


def test_old_rope_spelling_and_tied_fallback():
    raw = {**CONFIG_9B, "tie_word_embeddings": None}
    raw.pop("tie_word_embeddings")
    text = dict(CONFIG_9B["text_config"], rope_theta=5e6, partial_rotary_factor=0.5, tie_word_embeddings=True)
    text.pop("rope_parameters")
    text["rope_scaling"] = {"mrope_section": [22, 22, 20], "rope_type": "default"}
    config = ModelConfig.from_dict({**raw, "text_config": text})
    assert config.tie_word_embeddings is True
    assert (config.text.rope_theta, config.text.rotary_dim, config.text.mrope_section) == (5e6, 128, (22, 22, 20))


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"text_config": {**CONFIG_9B["text_config"], "layer_types": ["linear_attention"]}}, "layer_types"),
        ({"text_config": {**CONFIG_9B["text_config"], "hidden_act": "relu6"}}, "hidden_act"),
    ],
)
def test_invalid_configs_raise_config_error(patch, message):
    with pytest.raises(ConfigError, match=message):
        config = ModelConfig.from_dict({**CONFIG_9B, **patch})
        with torch.device("meta"):
            Qwen35Model(config)
