"""Which slice of each weight a rank holds, for tensor parallel size N (and expert parallel).

Rank r of N holds (model parameter names; `H` counts heads, `I` FFN widths):
- full attention: query heads [r*H_q/N, (r+1)*H_q/N) of `q_proj` (each head's query and
  gate rows together) and KV heads likewise of `k_proj` / `v_proj`; the matching input
  columns of `o_proj` (its output is summed over ranks). GQA pairs stay on one rank.
- Gated DeltaNet: key heads [r*H_k/N, ...) and value heads [r*H_v/N, ...): in `in_proj_qkv`
  and the conv channels that is three row ranges (q | k | v), in `in_proj_z`, `in_proj_b`,
  `in_proj_a`, `dt_bias`, `A_log` one; `out_proj` columns. Value head i reads key head
  i // (H_v / H_k), which the contiguous split keeps on the same rank.
- dense FFN and shared expert: `gate_proj` / `up_proj` rows (column parallel), `down_proj`
  columns (row parallel).
- routed experts: with expert parallel, experts [r*E/N, (r+1)*E/N) whole; without, every
  expert's inner width split like the dense FFN.
- embedding and LM head: vocab rows [r*V/N, (r+1)*V/N).
- everything else (norms, router, shared-expert gate, the vision tower): replicated.

`rank_config` is the config whose sizes are one rank's (heads / N, widths / N; the vocab
stays whole: the gathered logits are [n, V]): the model and its caches (KV pool, DeltaNet
state pool) are built from it, so every per-rank tensor has its per-rank shape from the start.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model.config import ModelConfig, TextConfig


@dataclass(frozen=True)
class Shard:
    """A rank's part of a full tensor: the `ranges` [(start, stop)] of dim `dim`, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


@dataclass(frozen=True)
class ParallelPlan:
    """Tensor parallel size `tp`, this process's `rank`, and whether MoE experts are split
    whole across the ranks (`expert_parallel`) instead of each expert's width."""

    tp: int = 1
    rank: int = 0
    expert_parallel: bool = False

    def __post_init__(self):
        if self.tp < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tp}")
        if not 0 <= self.rank < self.tp:
            raise ConfigError(f"rank must be in 0..{self.tp - 1}, got {self.rank}")

    def check(self, config: ModelConfig) -> None:
        """ConfigError naming every count that does not split evenly over `tp` ranks."""
        bad = [f"{name}={n}" for name, n in _split_counts(config.text, self.expert_parallel) if n % self.tp]
        if bad:
            raise ConfigError(f"tensor_parallel_size={self.tp} must divide {', '.join(bad)} "
                              f"(uneven splits are not supported)")

    def rank_config(self, config: ModelConfig) -> ModelConfig:
        """The config of one rank's shard (see the module docstring); checks the split first."""
        self.check(config)
        t, n = config.text, self.tp
        sizes = dict(num_attention_heads=t.num_attention_heads // n, num_key_value_heads=t.num_key_value_heads // n,
                     linear_num_key_heads=t.linear_num_key_heads // n,
                     linear_num_value_heads=t.linear_num_value_heads // n,
                     intermediate_size=t.intermediate_size // n if not t.is_moe else t.intermediate_size)
        if t.is_moe:
            sizes["shared_expert_intermediate_size"] = t.shared_expert_intermediate_size // n
            if not self.expert_parallel:
                sizes["moe_intermediate_size"] = t.moe_intermediate_size // n
        return dataclasses.replace(config, text=dataclasses.replace(t, **sizes))

    def expert_range(self, text: TextConfig) -> tuple[int, int]:
        """The experts [start, stop) this rank holds (all of them without expert parallel)."""
        if not text.is_moe:
            return (0, 0)
        if not self.expert_parallel:
            return (0, text.num_experts)
        per = text.num_experts // self.tp
        return (self.rank * per, (self.rank + 1) * per)

    def shard(self, param: str, shape: tuple[int, ...], text: TextConfig) -> Shard | None:
        """This rank's part of model parameter `param` (full shape `shape`), None when replicated."""
        if self.tp == 1:
            return None
        rule = _rule(param)
        if rule is None:
            return None
        kind, dim = rule
        if kind == "qkv":  # DeltaNet q | k | v rows (or conv channels)
            k, v = text.linear_key_dim, text.linear_value_dim
            return Shard(0, (self._part(0, k), self._part(k, 2 * k), self._part(2 * k, 2 * k + v)))
        if kind == "experts":
            if self.expert_parallel:
                return Shard(0, (self.expert_range(text),))
            if param.endswith("gate_up_proj"):
                inner = shape[1] // 2
                return Shard(1, (self._part(0, inner), self._part(inner, 2 * inner)))
            return Shard(2, (self._part(0, shape[2]),))
        return Shard(dim, (self._part(0, shape[dim]),))

    def _part(self, start: int, stop: int) -> tuple[int, int]:
        per = (stop - start) // self.tp
        return (start + self.rank * per, start + (self.rank + 1) * per)


def _split_counts(t: TextConfig, expert_parallel: bool) -> list[tuple[str, int]]:
    counts = [("num_attention_heads", t.num_attention_heads), ("num_key_value_heads", t.num_key_value_heads),
              ("linear_num_key_heads", t.linear_num_key_heads),
              ("linear_num_value_heads", t.linear_num_value_heads), ("vocab_size", t.vocab_size)]
    if not t.is_moe:
        return [*counts, ("intermediate_size", t.intermediate_size)]
    counts.append(("shared_expert_intermediate_size", t.shared_expert_intermediate_size))
    if expert_parallel:
        return [*counts, ("num_experts", t.num_experts)]
    return [*counts, ("moe_intermediate_size", t.moe_intermediate_size)]


# model parameter name (suffix) -> (kind, dim); "split" is one contiguous range of `dim`
_RULES = (
    (r"embed_tokens\.weight$|^lm_head\.weight$", ("split", 0)),
    (r"self_attn\.[qkv]_proj\.(weight|bias)$", ("split", 0)),
    (r"self_attn\.o_proj\.weight$", ("split", 1)),
    (r"linear_attn\.(in_proj_qkv|conv1d)\.weight$", ("qkv", 0)),
    (r"linear_attn\.(in_proj_[zba]\.weight|dt_bias|A_log)$", ("split", 0)),
    (r"linear_attn\.out_proj\.weight$", ("split", 1)),
    (r"mlp\.(shared_expert\.)?(gate|up)_proj\.weight$", ("split", 0)),
    (r"mlp\.(shared_expert\.)?down_proj\.weight$", ("split", 1)),
    (r"mlp\.experts\.(gate_up|down)_proj$", ("experts", 0)),
)


def _rule(param: str) -> tuple[str, int] | None:
    if not param.startswith("language_model.") and not param.startswith("lm_head."):
        return None  # the vision tower is replicated
    for pattern, rule in _RULES:
        if re.search(pattern, param):
            return rule
    return None
