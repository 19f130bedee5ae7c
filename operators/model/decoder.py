"""The hybrid text decoder: token embedding, [mixer + FFN] layers, final norm.

Each layer (seed 000 section 8): `x = x + mixer(input_layernorm(x))`, then
`x = x + mlp(post_attention_layernorm(x))`. The mixer is Gated DeltaNet
(`linear_attn`) or full attention (`self_attn`) as `layer_types` says; the FFN is
SwiGLU (dense) or `SparseMoE`. Works on packed tokens [T, D]; the step cache says how
T splits into sequences. Given the rows whose logits are wanted, the last layer computes
the rest of its output only for them (a prompt chunk needs its last row at most). Attribute names equal the checkpoint's
`model.language_model.*` names.
"""
from __future__ import annotations

import torch
from torch import nn

from vlbatch.operators.model.attention import FullAttention
from vlbatch.operators.model.cache import StepCache
from vlbatch.operators.model.config import TextConfig
from vlbatch.operators.model.deltanet import GatedDeltaNet
from vlbatch.operators.model.layers import RMSNorm, SwiGLU, embedding
from vlbatch.operators.model.moe import SparseMoE
from vlbatch.operators.model.rope import text_rope

# A long prefill step runs the FFN in blocks of this many rows: its [rows, inner]
# temporaries then stay a few MB, which the allocator reuses, instead of fresh pages
# (page faults) every layer; tokens are independent in the FFN.
FFN_ROWS = 512


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = FullAttention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache: StepCache, mixer_idx: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D], or [n, D] for the rows `keep` [n] only (the cache still gets
        every row's K/V or states). `mixer_idx` counts layers of this layer's kind."""
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, cache, mixer_idx, keep)
        else:
            h = self.self_attn(h, cos, sin, cache, mixer_idx, keep)
        # the mixer's and the FFN's outputs are fresh tensors (their output projections'):
        # the residual adds go into them (x + h == h + x bit for bit) and allocate nothing
        x = h.add_(x if keep is None else x[keep])
        if x.shape[0] <= FFN_ROWS:
            return self.mlp(self.post_attention_layernorm(x)).add_(x)
        for start in range(0, x.shape[0], FFN_ROWS):
            rows = x[start: start + FFN_ROWS]
            rows += self.mlp(self.post_attention_layernorm(rows))
        return x


class TextDecoder(nn.Module):
    """inputs_embeds [T, D] + MRoPE positions [3, T] -> hidden states [T, D] (before the final norm,
    which `Qwen35Model.logits` applies only to the rows it needs)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # per layer: its index among layers of the same kind (attn_idx / linear_idx)
        counts = {"linear_attention": 0, "full_attention": 0}
        self._mixer_idx = []
        for kind in cfg.layer_types:
            self._mixer_idx.append(counts[kind])
            counts[kind] += 1

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: StepCache,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """-> [T, D], or [n, D] for rows `keep` [n] (ascending): the last layer then runs its
        query / output side and FFN on those rows only (its K/V and states on all)."""
        cfg = self.cfg
        cos, sin = text_rope(position_ids, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
        x = inputs_embeds
        last = len(self.layers) - 1
        for i, (layer, idx) in enumerate(zip(self.layers, self._mixer_idx, strict=True)):
            x = layer(x, cos, sin, cache, idx, keep if i == last else None)
        return x
