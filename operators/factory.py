"""`load_engine`: a checkpoint directory -> a ready engine; the one place that chooses plain or
tensor-parallel loading, and `Engine` or `LeaderEngine`.

It sits above `engine/` and `parallel/` (which never import it): the engine takes a loaded model
and knows nothing of ranks; `parallel/` shards a model and wraps an engine for rank 0. A rank
other than 0 of a replica calls `parallel/replica.follow_pretrained` with the same arguments.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vlbatch.operators.engine.caches.memory import budgets_from_memory
from vlbatch.operators.engine.config import EngineConfig
from vlbatch.operators.engine.engine import Engine
from vlbatch.operators.model.loader import load_model, torch_dtype
from vlbatch.operators.parallel.replica import LeaderEngine, load_rank
from vlbatch.operators.preprocess.tokenizer import load_tokenizer
from vlbatch.operators.storage.named_file import checkpoint_text


def load_engine(model_dir: str | Path, *, device="cpu", dtype: torch.dtype | str = torch.float32,
                delta_rule: str = "auto", moe: str = "auto", memory_fraction: float | None = None,
                tensor_parallel_size: int = 1, expert_parallel: bool = False, **budgets) -> Engine:
    """Load the checkpoint in `model_dir` (config, safetensors, tokenizer.json,
    generation_config.json) into an `Engine`. `dtype`: a torch dtype or its name ("float32",
    "bfloat16", "float16"); `delta_rule` / `moe`: names in `operators/kernels/delta_rule.DELTA_RULE`
    / `moe.MOE` (auto: by the device); `budgets` are `EngineConfig` fields.
    `memory_fraction`: size the KV pool and prefix cache from the memory free after loading
    (`engine/caches/memory.py`); `kv_budget_bytes` / `prefix_cache_bytes` given here win.
    `tensor_parallel_size` > 1: this process is rank 0 of an initialised torch.distributed group of
    that size whose other ranks run `follow_pretrained` (`expert_parallel`: MoE experts split whole
    across the ranks); the result is a `LeaderEngine`."""
    model_dir = Path(model_dir)
    load_kw = {"device": device, "dtype": torch_dtype(dtype), "delta_rule": delta_rule, "moe": moe}
    if tensor_parallel_size > 1:
        model, comm = load_rank(model_dir, tensor_parallel_size, expert_parallel, leader=True, **load_kw)
    else:
        model, comm = load_model(model_dir, **load_kw), None
    tokenizer = load_tokenizer(model_dir)  # decodes as transformers' tokenizer of this checkpoint does
    if memory_fraction is not None:
        budgets = budgets_from_memory(model, memory_fraction, budgets, comm)
    config = EngineConfig(**budgets)
    if comm is None:
        return Engine(model, tokenizer, eos_ids(model_dir), config)
    return LeaderEngine(model, tokenizer, eos_ids(model_dir), config, comm)


def eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: generation_config.json's, else config.json's."""
    for name, key in (("generation_config.json", "eos_token_id"), ("config.json", "eos_token_id")):
        path = model_dir / name
        if path.exists():
            raw = json.loads(checkpoint_text(path))
            val = raw.get(key, raw.get("text_config", {}).get(key))
            if val is not None:
                return tuple(val) if isinstance(val, list) else (int(val),)
    return ()
