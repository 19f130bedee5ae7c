"""The batch engine: continuous batching over a hybrid (Gated DeltaNet + full attention) model.

Public API: `Engine.from_pretrained(model_dir, device=..., dtype=..., <budgets>)`,
`engine.generate(requests) -> Iterator[Result]`, `Request` / `MediaItem` /
`SamplingParams` / `Result`; `EngineLoop(engine, max_visual_tokens).run(requests)` shares
one engine between concurrent callers (threads) without draining it between their batches.

Request path (one file each): `request` + `media_spans` (types) -> `engine` (loop) -> `scheduler`
(continuous batching, chunked prefill, preemption, sibling gating) with `block_manager`
(paged KV ids), `state_pool` (DeltaNet slots + snapshots), `prefix_cache` (radix tree
with hybrid snapshots), `branch_points` (offline planning) -> `model_runner` (inputs,
`vision_cache`, `operators/kernels/attention`, the model's `forward_packed`) -> `sampler`.
Submodules import lazily: importing the package loads no model code.
"""
from __future__ import annotations

from vlbatch.operators.engine.media_spans import MediaItem
from vlbatch.operators.engine.request import Request, Result, SamplingParams, Timings

__all__ = ["Engine", "EngineConfig", "EngineLoop", "MediaItem", "Request", "Result", "SamplingParams", "Timings"]


def __getattr__(name: str):
    if name in ("Engine", "EngineConfig"):
        from vlbatch.operators.engine import engine

        return getattr(engine, name)
    if name == "EngineLoop":
        from vlbatch.operators.engine.loop import EngineLoop

        return EngineLoop
    raise AttributeError(name)
