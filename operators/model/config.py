"""Model configuration read from a checkpoint's config.json (dense `qwen3_5`, MoE `qwen3_5_moe`).

Owns: the frozen dataclasses every model part is built from (`TextConfig`,
`VisionConfig`, `ModelConfig`) and their parsing from the Hugging Face config.json.
Every size is read from the file; nothing is hard-wired to one model size. Missing
optional keys take the transformers 5.23 defaults of the same name.

Decisions:
- `rope_parameters` (transformers >= 5) and the older `rope_scaling` + top-level
  `rope_theta` / `partial_rotary_factor` spellings are both accepted.
- `layer_types` missing means every `full_attention_interval`-th layer (default 4)
  is full attention, the rest Gated DeltaNet (the transformers default).
- The MRoPE frequency layout is always interleaved (T H W T H W ...), as in
  transformers' Qwen3.5; `mrope_interleaved` is therefore not read.
- `tie_word_embeddings` is read from the top level, falling back to text_config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model.architectures import ARCHITECTURES
from vlbatch.operators.storage.named_file import checkpoint_text

_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class TextConfig:
    """The hybrid decoder: sizes of embeddings, mixers and FFNs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    # Gated DeltaNet
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    # FFN: dense (intermediate_size) or MoE (num_experts is not None)
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    max_position_embeddings: int = 262144

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def rotary_dim(self) -> int:
        """Rotated dims of each full-attention head (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")


@dataclass(frozen=True)
class VisionConfig:
    """The ViT: patch sizes, depth and widths, merger output width."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the square learned position grid (48 for 2304 positions)."""
        return int(round(self.num_position_embeddings**0.5))


@dataclass(frozen=True)
class ModelConfig:
    """Vision tower + decoder + the special token ids that join them."""

    model_type: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES.choices():
            raise ConfigError(f"config.json model_type must be one of {ARCHITECTURES.choices()}, "
                              f"got {model_type!r}")
        arch = ARCHITECTURES.load(model_type)
        text_raw, vision_raw = raw.get("text_config"), raw.get("vision_config")
        if not isinstance(text_raw, dict) or not isinstance(vision_raw, dict):
            raise ConfigError("config.json needs text_config and vision_config objects")
        tie = raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
        return cls(
            model_type=model_type,
            text=_text_config(text_raw, moe=arch.moe),
            vision=_vision_config(vision_raw),
            image_token_id=int(raw.get("image_token_id", 248056)),
            video_token_id=int(raw.get("video_token_id", 248057)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
            tie_word_embeddings=bool(tie),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(checkpoint_text(path))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)


def _req(raw: dict, key: str, where: str):
    if key not in raw:
        raise ConfigError(f"config.json {where} is missing {key!r}")
    return raw[key]


def _rope(raw: dict) -> tuple[float, float, tuple[int, int, int]]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    section = tuple(params.get("mrope_section", (11, 11, 10)))
    if len(section) != 3:
        raise ConfigError(f"text_config mrope_section must have 3 entries, got {list(section)}")
    return float(theta), float(factor), section  # type: ignore[return-value]


def _text_config(raw: dict, moe: bool) -> TextConfig:
    where = "text_config"
    n_layers = int(_req(raw, "num_hidden_layers", where))
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = int(raw.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers or any(t not in _LAYER_TYPES for t in layer_types):
        raise ConfigError(f"text_config layer_types must list {n_layers} entries from {_LAYER_TYPES}")
    theta, factor, section = _rope(raw)
    hidden = int(_req(raw, "hidden_size", where))
    n_heads = int(raw.get("num_attention_heads", 16))
    head_dim = int(raw.get("head_dim") or hidden // n_heads)
    if sum(section) * 2 != int(head_dim * factor):
        raise ConfigError(
            f"text_config mrope_section {list(section)} must sum to half the rotary dim {int(head_dim * factor)}"
        )
    moe_fields = {}
    if moe:
        moe_fields = dict(
            num_experts=int(_req(raw, "num_experts", where)),
            num_experts_per_tok=int(_req(raw, "num_experts_per_tok", where)),
            moe_intermediate_size=int(_req(raw, "moe_intermediate_size", where)),
            shared_expert_intermediate_size=int(_req(raw, "shared_expert_intermediate_size", where)),
        )
    return TextConfig(
        vocab_size=int(_req(raw, "vocab_size", where)),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=n_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads", 4)),
        head_dim=head_dim,
        attention_bias=bool(raw.get("attention_bias", False)),
        rope_theta=theta,
        partial_rotary_factor=factor,
        mrope_section=section,
        linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(raw.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(raw.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(raw.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(raw.get("linear_num_value_heads", 32)),
        intermediate_size=int(raw.get("intermediate_size", 12288)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 262144)),
        **moe_fields,
    )


def _vision_config(raw: dict) -> VisionConfig:
    rope = raw.get("rope_parameters") or {}
    patch, temporal = raw.get("patch_size", 16), raw.get("temporal_patch_size", 2)
    if not isinstance(patch, int) or not isinstance(temporal, int):
        raise ConfigError("vision_config patch_size and temporal_patch_size must be integers")
    return VisionConfig(
        depth=int(raw.get("depth", 27)),
        hidden_size=int(raw.get("hidden_size", 1152)),
        intermediate_size=int(raw.get("intermediate_size", 4304)),
        num_heads=int(raw.get("num_heads", 16)),
        in_channels=int(raw.get("in_channels", 3)),
        patch_size=patch,
        temporal_patch_size=temporal,
        spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
        out_hidden_size=int(raw.get("out_hidden_size", 3584)),
        num_position_embeddings=int(raw.get("num_position_embeddings", 2304)),
        hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
    )
