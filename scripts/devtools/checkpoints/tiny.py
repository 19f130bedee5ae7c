"""Write tiny random-weight Qwen3.5 checkpoints in the real Hugging Face layout.

Variants (all sizes far below the real ones, shapes and structure the same):
- ``dense``: untied embedding and LM head, like Qwen3.5-9B.
- ``dense_tied``: tied embedding and LM head, like Qwen3.5-4B.
- ``moe``: routed experts plus a gated shared expert, like Qwen3.5-35B-A3B.
- ``dense_uneven`` / ``moe_uneven``: ``dense`` / ``moe`` with one KV head, one DeltaNet key
  head and three value heads (and 3 experts), so a 2-way tensor / expert parallel split is
  refused (the other variants' head, width and expert counts all split evenly by 2).

Weights are produced by transformers' own classes and `save_pretrained` so the
tensor names and file layout are exactly those a real checkpoint has; the
processor files carry the 9B preprocessing values from the architecture seed.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from vlbatch.devtools.checkpoints import tokenizer as tok

TINY_VARIANTS = ("dense", "dense_tied", "moe", "dense_uneven", "moe_uneven")
_UNEVEN = {"num_key_value_heads": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 3}
_VARIANT_TEXT = {"dense_uneven": _UNEVEN, "moe_uneven": {**_UNEVEN, "num_experts": 3}}

_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 64,  # an 8 x 8 learned grid (9B: 48 x 48)
    "hidden_act": "gelu_pytorch_tanh",
    "deepstack_visual_indexes": [],
}
_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,  # [linear x3, full] x 2
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # q width 256 != hidden 64, the 4B "trap"
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # head expansion x2 as in 9B
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,  # 16 of 64 dims rotated -> 8 frequencies
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
}
_MOE = {
    "num_hidden_layers": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}

# what the image and video processors' configs share (the checkpoint's preprocessor_config.json and
# video_preprocessor_config.json; what differs: their types and sizes, the video's frame sampling)
_PIXELS = {
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
IMAGE_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", **_PIXELS,
                   "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
VIDEO_PROCESSOR = {"video_processor_type": "Qwen3VLVideoProcessor", **_PIXELS,
                   "size": {"shortest_edge": 4096, "longest_edge": 25165824},
                   "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768}


def tiny_config_dict(variant: str = "dense", vision_overrides: dict | None = None, **text_overrides) -> dict:
    """The config.json content (before transformers normalises it) for a variant.

    `vision_overrides` / `text_overrides` replace entries of the vision / text config
    (the bundled demo model uses them for its sizes)."""
    if variant not in TINY_VARIANTS:
        raise ValueError(f"variant must be one of {TINY_VARIANTS}, got {variant!r}")
    ids = tok.special_token_ids()
    vocab = -(-(max(ids.values()) + 1) // 64) * 64
    moe = variant.startswith("moe")
    text = copy.deepcopy(_TEXT)
    if moe:
        text.update(_MOE)
    text.update(_VARIANT_TEXT.get(variant, {}))
    text.update(
        vocab_size=vocab,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        tie_word_embeddings=variant == "dense_tied",
    )
    text.update(text_overrides)
    vision = {**_VISION, "out_hidden_size": text["hidden_size"], **(vision_overrides or {})}
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": variant == "dense_tied",
    }


def build_reference_model(
    variant: str = "dense", seed: int = 0, init_std: float = 0.05, vision_overrides: dict | None = None,
    **text_overrides,
):
    """The transformers model for a variant, randomly initialised from `seed` (fp32, eval)."""
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    cfg = tiny_config_dict(variant, vision_overrides, **text_overrides)
    cfg.pop("model_type")
    cfg["text_config"]["initializer_range"] = init_std
    cfg["vision_config"]["initializer_range"] = init_std
    if variant.startswith("moe"):
        config, cls = Qwen3_5MoeConfig(**cfg), Qwen3_5MoeForConditionalGeneration
    else:
        config, cls = Qwen3_5Config(**cfg), Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomise_norms(model, seed)
    return model


def _randomise_norms(model, seed: int) -> None:
    """Give norm weights, A_log and dt_bias non-trivial values so tests see them.

    transformers initialises zero-centred RMSNorm weights to 0 (scale 1); a port
    that forgot the `1 + w` would still match. Random values make it fail.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")) or ".norm." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def write_tokenizer_and_processor(out: Path) -> None:
    """Tokenizer, chat template and processor configs (shared by every variant)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps(tok.tokenizer_config(), indent=2))
    shutil.copy(Path(tok.__file__).parent / "assets" / "chat_template.jinja", out / "chat_template.jinja")
    (out / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2))


def make_tiny_checkpoint(
    out_dir: str | Path,
    variant: str = "dense",
    *,
    seed: int = 0,
    shards: int = 1,
    **text_overrides,
) -> Path:
    """Write a tiny random checkpoint to `out_dir`; `shards > 1` writes an indexed sharded set."""
    out = Path(out_dir)
    model = build_reference_model(variant, seed=seed, **text_overrides)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    max_shard = f"{max(total // max(shards, 1) + 1, 1) // 1000 + 1}KB" if shards > 1 else "50GB"
    model.save_pretrained(out, max_shard_size=max_shard, safe_serialization=True)
    ids = tok.special_token_ids()
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer_and_processor(out)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random Qwen3.5 checkpoint (HF layout).")
    ap.add_argument("out_dir")
    ap.add_argument("--variant", choices=TINY_VARIANTS, default="dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    args = ap.parse_args(argv)
    path = make_tiny_checkpoint(args.out_dir, args.variant, seed=args.seed, shards=args.shards)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
