"""`Qwen35Model`: vision tower + hybrid decoder + LM head, and the two ways to run it.

- `forward(input_ids [B, L], pixel_values=..., ..., cache=None, logits_to_keep=0)`:
  the transformers-like call for B equal-length sequences. Embeds, writes the merged
  visual features over the image / video placeholder tokens, builds MRoPE positions
  (or takes `position_ids`), runs one step and returns logits [B, n, V]. With a
  `ContiguousCache` the first call is the prefill and later calls continue (decode one
  token at a time); positions then come from the cache's `rope_deltas`.
- `forward_packed(inputs_embeds [T, D], position_ids [3, T], cache, logits_indices [n])`:
  the engine's step over sequences of different lengths packed in `cache.query_lens`
  order, with any `StepCache` (paged or contiguous); returns logits [n, V].

Building blocks: `embed(ids)`, `visual(pixel_values, grid_thw)` (merged features),
`encode_media` (features split per item), `logits(hidden)`.
Submodule names (`visual`, `language_model`, `lm_head`) equal the checkpoint names
without the leading `model.`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbatch.operators.errors import InputError
from vlbatch.operators.model.cache import StepCache
from vlbatch.operators.model.config import ModelConfig
from vlbatch.operators.model.contiguous_cache import ContiguousCache
from vlbatch.operators.model.decoder import TextDecoder
from vlbatch.operators.model.deltanet import GatedDeltaNet
from vlbatch.operators.model.moe import Experts
from vlbatch.operators.model.positions import mm_token_types, mrope_positions
from vlbatch.operators.model.vision import VisionTower


class Qwen35Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.visual = VisionTower(config.vision)
        self.language_model = TextDecoder(config.text)
        text = config.text
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.mtp_weights: dict[str, torch.Tensor] = {}  # `mtp.*` tensors when the checkpoint has them

    # -- building blocks -----------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> embeddings [..., D]."""
        return self.language_model.embed_tokens(input_ids)

    def encode_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Merged features of each image / video: tuple of [t * h * w / m^2, D]."""
        feats = self.visual(pixel_values.to(self.dtype), grid_thw)
        sizes = (grid_thw.prod(-1) // self.config.vision.spatial_merge_size**2).tolist()
        return feats.split(sizes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [n, D] -> [n, V] (tied head reuses the embedding)."""
        hidden = self.language_model.norm(hidden)
        weight = self.lm_head.weight if self.lm_head is not None else self.language_model.embed_tokens.weight
        return F.linear(hidden, weight)  # = hidden @ weight^T (a linear layer: profilers count it as one)

    def fuse_projections(self) -> Qwen35Model:
        """Load-time transform: projections that read the same input (DeltaNet qkv/z,
        attention q/k/v, FFN gate/up) run as one matmul each. Parameters keep their
        checkpoint names and values (they become views of the fused weights)."""
        for module in self.language_model.modules():
            if module is not self and hasattr(module, "fuse_"):
                module.fuse_()
        return self

    def use_delta_kernels(self, kernels) -> Qwen35Model:
        """Transform: every Gated DeltaNet layer runs its rule through `kernels`
        (`operators/kernels/delta_rule`: torch, or fla's on CUDA)."""
        for module in self.language_model.modules():
            if isinstance(module, GatedDeltaNet):
                module.kernels = kernels
        return self

    def use_experts(self, kernel) -> Qwen35Model:
        """Transform: every MoE layer computes its routed experts through `kernel`
        (`operators/kernels/moe.ExpertsKernel`); a dense model is left as it is."""
        for module in self.language_model.modules():
            if isinstance(module, Experts):
                module.kernel = kernel
        return self

    # -- engine step -----------------------------------------------------------------
    @torch.inference_mode()
    def forward_packed(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: StepCache, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """inputs_embeds [T, D] packed in `cache.query_lens` order, position_ids [3, T],
        logits_indices [n] (rows of T) -> logits [n, V]."""
        if inputs_embeds.shape[0] != sum(cache.query_lens):
            raise InputError(f"{inputs_embeds.shape[0]} packed tokens but query_lens sum to {sum(cache.query_lens)}")
        keep = None if logits_indices.numel() == inputs_embeds.shape[0] else logits_indices
        hidden = self.language_model(inputs_embeds, position_ids, cache, keep)
        return self.logits(hidden if keep is not None else hidden[logits_indices])

    # -- transformers-like call ---------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: ContiguousCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, L] -> logits [B, n, V]; n = L (logits_to_keep=0), the last k
        (logits_to_keep=k) or the given positions (1-D tensor of indices into L).

        `attention_mask` is accepted so a processor's output can be passed whole; it must
        be all ones (padding is not supported: the engine packs sequences instead)."""
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise InputError("padded batches are not supported: pass sequences of equal length (no padding)")
        b, length = input_ids.shape
        embeds = self.embed(input_ids)
        embeds = self._place(input_ids, embeds, pixel_values, image_grid_thw, self.config.image_token_id, "image")
        embeds = self._place(input_ids, embeds, pixel_values_videos, video_grid_thw, self.config.video_token_id,
                             "video")
        if cache is None:
            cache = ContiguousCache(self.config.text, b, device=self.device, dtype=self.dtype, capacity=length)
        if cache.batch_size != b:
            raise InputError(f"cache holds {cache.batch_size} sequences, input_ids has {b}")
        positions = self._positions(input_ids, image_grid_thw, video_grid_thw, mm_token_type_ids, position_ids, cache)
        keep = _keep_indices(logits_to_keep, length, input_ids.device)
        flat_keep = (torch.arange(b, device=input_ids.device)[:, None] * length + keep[None]).reshape(-1)
        cache.begin_step((length,) * b)
        logits = self.forward_packed(embeds.reshape(b * length, -1), positions.reshape(3, -1), cache, flat_keep)
        cache.end_step()
        return logits.view(b, keep.numel(), -1)

    def _place(self, input_ids, embeds, pixels, grid_thw, token_id: int, kind: str) -> torch.Tensor:
        """Write merged visual features over the placeholder tokens (row-major over the batch)."""
        mask = input_ids == token_id
        if pixels is None:
            if bool(mask.any()):
                raise InputError(f"input_ids has {kind} tokens but no {kind} pixel values were given")
            return embeds
        if grid_thw is None:
            raise InputError(f"{kind} pixel values need {kind}_grid_thw")
        feats = torch.cat(self.encode_media(pixels, grid_thw)).to(embeds.dtype)
        if int(mask.sum()) != feats.shape[0]:
            raise InputError(f"{int(mask.sum())} {kind} tokens but {feats.shape[0]} {kind} features")
        embeds = embeds.clone()
        embeds[mask] = feats
        return embeds

    def _positions(self, input_ids, image_grid_thw, video_grid_thw, mm_token_type_ids, position_ids, cache):
        """MRoPE positions [3, B, L] for this call; records `cache.rope_deltas` at prefill."""
        b, length = input_ids.shape
        dev = input_ids.device
        fresh = all(n == 0 for n in cache.seq_lens)
        if position_ids is not None:
            if position_ids.dim() == 2:
                position_ids = position_ids[None].expand(3, b, length)
            elif position_ids.shape[0] == 4:
                position_ids = position_ids[1:]  # drop the text row transformers prepends
            if fresh:
                cache.rope_deltas = position_ids.amax(dim=(0, 2)) + 1 - length
            return position_ids.to(dev)
        has_media = image_grid_thw is not None or video_grid_thw is not None
        if fresh:
            if has_media:
                if mm_token_type_ids is None:
                    mm_token_type_ids = mm_token_types(input_ids, self.config.image_token_id,
                                                       self.config.video_token_id)
                pos, deltas = mrope_positions(
                    mm_token_type_ids, image_grid_thw, video_grid_thw, self.config.vision.spatial_merge_size
                )
            else:
                pos, deltas = torch.arange(length, device=dev).expand(3, b, length), torch.zeros(b, dtype=torch.long)
            cache.rope_deltas = deltas.to(dev)
            return pos.to(dev)
        if has_media:
            raise InputError("images and videos must be in the first (prefill) call of a cached sequence")
        past = torch.tensor(cache.seq_lens, device=dev)
        deltas = cache.rope_deltas if cache.rope_deltas is not None else torch.zeros_like(past)
        pos = past[:, None] + deltas[:, None] + torch.arange(length, device=dev)[None]
        return pos[None].expand(3, b, length)


def _keep_indices(logits_to_keep: int | torch.Tensor, length: int, device) -> torch.Tensor:
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep.to(device=device, dtype=torch.long).reshape(-1)
    if logits_to_keep < 0 or logits_to_keep > length:
        raise InputError(f"logits_to_keep must be in 0..{length}, got {logits_to_keep}")
    return torch.arange(length - logits_to_keep if logits_to_keep else 0, length, device=device)
