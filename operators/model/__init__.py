"""Our Qwen3.5 implementation (dense `qwen3_5` and MoE `qwen3_5_moe`): vision tower, hybrid
Gated DeltaNet / full-attention decoder, safetensors loading. transformers is not imported.

Public API
----------
`load_model(model_dir, device="cpu", dtype=torch.float32, delta_rule="auto", moe="auto")
-> Qwen35Model` (eval mode, no grads; `delta_rule` / `moe`: names in the kernel
registries `operators/kernels/delta_rule.DELTA_RULE` / `operators/kernels/moe.MOE`).

`model.forward(input_ids [B, L], pixel_values=None, image_grid_thw=None,
pixel_values_videos=None, video_grid_thw=None, mm_token_type_ids=None, position_ids=None,
cache=None, logits_to_keep=0, attention_mask=None) -> logits [B, n, V]`
    B equal-length sequences (no padding: an `attention_mask` must be all ones). Inputs
    are named and shaped as the processor returns them (`pixel_values [N_patch, 1536]`, `*_grid_thw [n, 3]`).
    Positions: `position_ids` ([3, B, L], [4, B, L] or [B, L]) if given, else MRoPE
    positions from `mm_token_type_ids` (derived from the placeholder ids when omitted).
    `cache=ContiguousCache(model.config.text, B, dtype=model.dtype)`: the first call is
    the prefill, later calls continue the same sequences (decode: one token each);
    decode positions are `seq_len + rope_delta` as in transformers. Media only in the
    first call. `logits_to_keep`: 0 = all positions, k = the last k, or a 1-D tensor of
    positions.

`model.forward_packed(inputs_embeds [T, D], position_ids [3, T], cache: StepCache,
logits_indices [n]) -> logits [n, V]`
    The engine's step: sequences of different lengths packed in `cache.query_lens`
    order; the cache (`operators/model/cache.py`) stores K/V and DeltaNet states.

Building blocks: `model.embed(ids) -> [..., D]`, `model.visual(pixel_values, grid_thw) ->
[N_vis, D]` (merged features), `model.encode_media(pixel_values, grid_thw) -> tuple of
[N_vis_i, D]` per image / video, `model.logits(hidden [n, D]) -> [n, V]` (final norm +
head), `mrope_positions(mm_token_type_ids, image_grid_thw, video_grid_thw, merge)`.

Modules: config (config.json), layers (norms, SwiGLU), moe, rope, attention,
deltanet (+ ops/conv; the rule is `operators/kernels/delta_rule`), decoder, vision, positions, model,
contiguous_cache, loader, greedy (reference greedy decoding loop).
"""
from __future__ import annotations

import importlib

# name -> the module defining it, imported on first use (PEP 562): `operators/model/config.py` (no torch)
# stays importable without torch's seconds of start-up (`vlbatch validate` reads config.json only)
_EXPORTS = {
    "StepCache": "cache", "ModelConfig": "config", "TextConfig": "config", "VisionConfig": "config",
    "ContiguousCache": "contiguous_cache", "CheckpointError": "loader", "load_model": "loader",
    "Qwen35Model": "model", "mrope_positions": "positions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
