"""Runs one scheduled step through the model: inputs, vision features, paged cache, logits.

Owns the KV tensors `[n_attn, 2, num_blocks, bs, H_kv, D]` (model dtype) and the DeltaNet
`StatePool`, and implements `StepCache` over them (`PagedStepCache`, `step_cache.py`). Per step:
1. copy-on-write copies of partially shared tail blocks;
2. input ids and MRoPE positions per chunk: prompt positions from the request's
   `position_ids`, generated token i at `i + rope_delta` on all three axes;
3. embeddings, with vision features written over placeholder rows. Features come from
   the sequence (already fetched for an earlier chunk), the vision cache, or the vision
   tower — one item per call, so an item's features never depend on what else ran (uint8
   patches are normalised on the device first, `MediaItem.model_input`). A
   prefix hit that covers an item never reaches this point for it: no tower call;
4. `model.forward_packed` -> logits for the chunks that end at their last token; its
   attention layers call `self.attention` (`operators/kernels/attention`, chosen once).
Step planning reads only host state (block tables, slots, token ids as Python ints) and
copies its index tensors to the device without waiting on it. With `static_decode`,
decode-only steps run instead on the padded static buffers of `static_decode.StaticDecode`
(CUDA graphs on CUDA); the KV tensor then has one scratch block more (`scratch_block`)
and the pool a scratch slot, for the padded rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlbatch.operators.engine.caches.state_pool import StatePool
from vlbatch.operators.engine.caches.vision_cache import VisionCache
from vlbatch.operators.engine.runner.static_decode import StaticDecode, default_buckets
from vlbatch.operators.engine.runner.step_cache import PagedStepCache
from vlbatch.operators.engine.scheduling.scheduler import StepPlan
from vlbatch.operators.errors import InputError
from vlbatch.operators.kernels.attention import select_attention
from vlbatch.operators.kernels.attention.base import PagedAttention
from vlbatch.operators.kernels.attention.layout import PagedLayout, to_device


@dataclass
class RunnerStats:
    vision_encodes: int = 0  # media items run through the vision tower
    vision_cache_hits: int = 0
    prefill_tokens: int = 0  # prompt (or recomputed) tokens run through the decoder
    decode_tokens: int = 0
    steps: int = 0
    static_decode_steps: int = 0  # of `steps`: decode-only steps on the padded static buffers


class ModelRunner:
    pool_class = StatePool  # the DeltaNet state pool's class (a tensor-parallel leader logs its ops)

    def __init__(self, model, num_blocks: int, block_size: int, num_slots: int, vision_cache: VisionCache,
                 attention: PagedAttention | None = None, static_decode: bool = False,
                 buckets: tuple[int, ...] | None = None):
        """`static_decode`: decode-only steps on padded static buffers, `buckets` their batch
        sizes (default 1, 2, 4, ... covering `num_slots`)."""
        text = model.config.text
        self.model, self.block_size = model, block_size
        self.device, self.dtype = model.device, model.dtype
        self.merge = model.config.vision.spatial_merge_size
        self.scratch_block = num_blocks if static_decode else None  # past the BlockManager's ids
        self.kv = torch.zeros(len(text.full_layers), 2, num_blocks + int(static_decode), block_size,
                              text.num_key_value_heads, text.head_dim, dtype=self.dtype, device=self.device)
        self.pool = self.pool_class(num_slots, len(text.linear_layers), text.linear_conv_dim,
                                    text.linear_conv_kernel_dim, text.linear_num_value_heads,
                                    text.linear_key_head_dim, text.linear_value_head_dim,
                                    dtype=self.dtype, device=self.device, scratch=static_decode)
        self.vision_cache = vision_cache
        # chosen once; its decode gathers' buffers are reused across layers and steps
        self.attention = attention if attention is not None else select_attention("auto", model.device)
        self.static = StaticDecode(self, buckets or default_buckets(num_slots)) if static_decode else None
        self._static_accepts = self.static.accepts if self.static is not None else _never  # decided once
        self.stats = RunnerStats()

    @property
    def kv_bytes_per_token(self) -> int:
        per_block = self.kv[:, :, 0].numel() * self.kv.element_size()
        return per_block // self.block_size

    def copy_blocks(self, copies) -> None:
        for src, dst, n in copies:
            self.kv[:, :, dst, :n] = self.kv[:, :, src, :n]

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [n, V] (float32) of the chunks with `sample`, in plan order."""
        self.copy_blocks(plan.copies)
        static = self._static_accepts(plan)
        logits = self.static.run(plan) if static else self._run_eager(plan.chunks)
        self.stats.steps += 1
        self.stats.static_decode_steps += int(static)
        if static:  # every chunk one generated token
            self.stats.decode_tokens += len(plan.chunks)
            return logits
        for c in plan.chunks:
            self.stats.prefill_tokens += max(0, min(c.end, c.seq.prompt_len) - c.start)
            self.stats.decode_tokens += max(0, c.end - max(c.start, c.seq.prompt_len))
        return logits

    def _run_eager(self, chunks) -> torch.Tensor:
        """Logits [n, V] (float32) of any step: packed rows of the step's own shapes."""
        input_ids = to_device(torch.tensor([t for c in chunks for t in c.seq.token_ids[c.start: c.end]],
                                           dtype=torch.long), self.device)
        positions = to_device(_step_positions(chunks), self.device)
        embeds = self.model.embed(input_ids)
        row = 0
        for c in chunks:
            self._place_vision(c, embeds, row)
            row += c.length
        ends, row = [], 0
        for c in chunks:
            row += c.length
            if c.sample:
                ends.append(row - 1)
        layout = PagedLayout.build([c.seq.block_table for c in chunks], [c.start for c in chunks],
                                   [c.end for c in chunks], self.block_size, self.device,
                                   rows=ends if len(ends) < row else None)
        host_slots = [c.seq.slot for c in chunks]
        slots = to_device(torch.tensor(host_slots, dtype=torch.long), self.device)
        cache = PagedStepCache(self.kv, self.pool, layout, tuple(c.length for c in chunks), slots, self.attention,
                               StatePool.contiguous_run(host_slots))
        logits = self.model.forward_packed(embeds, positions, cache, to_device(torch.tensor(ends, dtype=torch.long),
                                                                               self.device))
        return logits.float()

    # -- vision ---------------------------------------------------------------------------
    def _place_vision(self, c, embeds: torch.Tensor, row0: int) -> None:
        """Each media item's features over its placeholder runs inside the chunk: run [s, e) of
        the prompt holds feature rows off .. off + e - s (in run order), a slice copy per run."""
        seq = c.seq
        for j, item in enumerate(seq.request.media):
            if item.spans[-1][1] <= c.start or item.spans[0][0] >= c.end:
                continue
            feats, off = None, 0
            for s, e in item.spans:
                lo, hi = max(s, c.start), min(e, c.end)
                if lo < hi:
                    feats = self._features(seq, j, item) if feats is None else feats
                    embeds[row0 + lo - c.start: row0 + hi - c.start] = feats[off + lo - s: off + hi - s]
                off += e - s
            if item.spans[-1][1] <= c.end:
                seq.features.pop(j, None)  # the item is fully placed: drop the sequence's reference

    def _features(self, seq, j: int, item) -> torch.Tensor:
        feats = seq.features.get(j)
        if feats is not None:
            return feats
        feats = self.vision_cache.get(item.content_hash)
        if feats is not None:
            self.stats.vision_cache_hits += 1
        else:
            grid = torch.tensor([item.grid_thw], dtype=torch.long, device=self.device)
            # uint8 levels travel to the device as uint8 and are normalised there (`MediaItem.model_input`)
            (feats,) = self.model.encode_media(item.model_input(self.device, self.dtype), grid)
            self.stats.vision_encodes += 1
            if feats.shape[0] != item.num_tokens:
                raise InputError(f"request {seq.id!r}: {item.kind} grid {item.grid_thw} gives {feats.shape[0]} "
                                 f"features for {item.num_tokens} placeholders")
            self.vision_cache.put(item.content_hash, feats)
        seq.features[j] = feats
        return feats


def _never(plan) -> bool:
    """`_static_accepts` of a runner without static decode."""
    return False


def _step_positions(chunks) -> torch.Tensor:
    """[3, T] MRoPE positions of a step's chunks; runs of generated tokens (decodes) are
    collected as plain ints and become one tensor (no per-sequence tensors)."""
    parts: list[torch.Tensor] = []
    gen: list[int] = []  # positions of consecutive chunks that lie past their prompts
    for c in chunks:
        seq = c.seq
        if c.start >= seq.prompt_len:
            gen.extend(range(c.start + seq.request.rope_delta, c.end + seq.request.rope_delta))
            continue
        if gen:
            parts.append(torch.tensor(gen, dtype=torch.long)[None].expand(3, -1))
            gen = []
        parts.append(_positions(seq, c.start, c.end))
    if gen:
        parts.append(torch.tensor(gen, dtype=torch.long)[None].expand(3, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()


def _positions(seq, start: int, end: int) -> torch.Tensor:
    """[3, end - start] MRoPE positions of sequence positions [start, end)."""
    req = seq.request
    L = seq.prompt_len
    parts = []
    if start < L:
        parts.append(req.position_ids[:, start: min(end, L)])
    if end > L:
        gen = torch.arange(max(start, L), end, dtype=torch.long) + req.rope_delta
        parts.append(gen[None].expand(3, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
