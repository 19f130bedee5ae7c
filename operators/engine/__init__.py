"""The batch engine: continuous batching over a hybrid (Gated DeltaNet + full attention) model.

Public API: `Engine(model, tokenizer, eos_ids, EngineConfig(...))` over a loaded model (a
checkpoint directory is loaded by `vlbatch.operators.factory.load_engine`), `engine.generate(requests)
-> Iterator[Result]`, `Request` / `MediaItem` / `SamplingParams` / `Result`;
`EngineLoop(engine, max_visual_tokens).run(requests)` shares one engine between concurrent callers
(threads) without draining it between their batches.

The request path: `request` + `media_spans` (types), `config` (`EngineConfig`) -> `engine` (the
step loop) -> `scheduling/` (continuous batching, chunked prefill, preemption; the prefix planner: where
snapshots go, sibling gating) over
`caches/` (paged KV block ids, DeltaNet state slots + snapshots, the radix prefix cache, the vision
cache, pool sizing from free memory) -> `runner/` (step inputs, vision features, paged attention,
the model's `forward_packed`) -> `sampler`. Layers inside go one way: engine/loop -> runner ->
scheduling -> caches -> types. Submodules import lazily: importing the package loads no model code.
"""
from __future__ import annotations

from vlbatch.operators.engine.media_spans import MediaItem
from vlbatch.operators.engine.request import Request, Result, SamplingParams, Timings

__all__ = ["Engine", "EngineConfig", "EngineLoop", "MediaItem", "Request", "Result", "SamplingParams", "Timings"]


def __getattr__(name: str):
    if name == "Engine":
        from vlbatch.operators.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from vlbatch.operators.engine.config import EngineConfig

        return EngineConfig
    if name == "EngineLoop":
        from vlbatch.operators.engine.loop import EngineLoop

        return EngineLoop
    raise AttributeError(name)
