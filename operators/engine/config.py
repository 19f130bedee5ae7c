"""`EngineConfig`: the engine's budgets and choices, validated once (the fields of
`load_engine(**budgets)` and of the job's `engine:` section)."""
from __future__ import annotations

from dataclasses import dataclass

from vlbatch.operators.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 256 << 20
    prefix_cache_bytes: int = 128 << 20
    vision_cache_bytes: int = 256 << 20
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = None  # None: prefill chunks only limited by the token budget
    block_size: int = 16
    attention: str = "auto"  # `vlbatch.operators.kernels.attention.CHOICES` (auto: by the model's device)
    static_decode: bool = False  # decode-only steps padded to batch buckets (CUDA graphs on CUDA)
    prefix_cache: str = "radix"  # `caches.PREFIX_CACHES` (checked by the engine): radix, or "dict", its naive twin
    grammar_compile_s: float = 10.0  # a response format's compile deadline (`grammar_compile.GrammarBudget`)
    grammar_max_bytes: int = 128 << 10  # the largest response format source compiled at all

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1 or None, got {self.chunk_size}")
        if not self.grammar_compile_s > 0 or self.grammar_max_bytes < 1:
            raise ConfigError(f"grammar_compile_s must be > 0 and grammar_max_bytes >= 1, got "
                              f"{self.grammar_compile_s} and {self.grammar_max_bytes}")
        for name in ("kv_budget_bytes", "prefix_cache_bytes", "vision_cache_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
