"""Model backends behind the model stage. Contract (both implementations):

    backend.generate(rows: list[Prepared]) -> dict[request_id, ReqOut]

covers every request of every row (one ReqOut each, possibly an error), greedy when
`sampling.temperature == 0`; it may be called from several threads at once (the model
stage runs concurrent calls on one actor). `backend.take_usage() -> Usage` gives the
model's busy seconds and vision-tower counters since the previous take (so the figures
of all calls sum to the actor's totals).

- `EngineBackend`: vlbatch.operators.engine (paged KV, prefix and vision caches) behind an
  `EngineLoop`: every call's requests join one continuous batch: the product.
- `TransformersBackend`: transformers' `generate()`, one request at a time, calls
  serialised: the reference and the benchmark baseline (no caches, slow).
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import InputError
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.rows import Prepared


@dataclass(frozen=True)
class ReqOut:
    """What the backend returns for one request (backend-neutral)."""

    answer: str | None
    thinking: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    generated_tokens: int | None
    cached_tokens: int | None
    error_type: str | None = None
    error_message: str | None = None


def request_seed(base: int, rid: str) -> int:
    return (int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16) ^ base) & 0x7FFFFFFF


def processor_dict(row: Prepared, i: int) -> dict[str, np.ndarray]:
    """Prompt i of a Prepared row in the processor's output layout (batch of one)."""
    ids = np.asarray(row.input_ids[i], np.int64)[None]
    out = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "mm_token_type_ids": np.asarray(row.mm_token_type_ids[i], np.int64)[None],
        "position_ids": np.asarray(row.position_ids[i], np.int64).reshape(3, 1, -1),
        "rope_deltas": np.asarray([row.rope_deltas[i]], np.int64),
    }
    grid = np.asarray(row.grid_thw, np.int64)[None]
    pixels = np.require(row.pixel_values, requirements=["W"])  # Arrow buffers are read-only; torch wants writable
    if row.media_type == "image":
        out["pixel_values"], out["image_grid_thw"] = pixels, grid
    else:
        out["pixel_values_videos"], out["video_grid_thw"] = pixels, grid
    return out


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass(frozen=True)
class Usage:
    """Model work since the previous `take_usage` (sums over takes are exact)."""

    busy_s: float = 0.0  # seconds the model computed (overlapping calls' waits not double counted)
    busy_cpu_s: float = 0.0  # CPU seconds of the thread computing in them (engine backend; else busy_s)
    vision_cache_hits: int = 0
    vision_encodes: int = 0


class _UsageMeter:
    """Cumulative Usage -> the delta since the last take, thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last = Usage()

    def take(self, read) -> Usage:
        """`read()` gives the cumulative Usage; it runs under the lock, so deltas never go negative."""
        with self._lock:
            total = read()
            last, self._last = self._last, total
        return Usage(total.busy_s - last.busy_s, total.busy_cpu_s - last.busy_cpu_s,
                     total.vision_cache_hits - last.vision_cache_hits, total.vision_encodes - last.vision_encodes)


def local_model_path(cfg: JobConfig) -> str:
    """`model.path` on this node: itself when local, else downloaded once per node (s3://...)."""
    from vlbatch.operators.storage.checkpoint_cache import resolve_model_path

    return resolve_model_path(cfg.model.path, cfg.storage.options(), cfg.model.cache_dir)


class EngineBackend:
    def __init__(self, cfg: JobConfig):
        from vlbatch.operators.engine import Engine, EngineLoop

        self.cfg = cfg
        self.engine = Engine.from_pretrained(local_model_path(cfg), device=resolve_device(cfg.model.device),
                                             dtype=cfg.model.dtype,
                                             **cfg.model.engine.engine_kwargs())
        self.loop = EngineLoop(self.engine, max_visual_tokens=cfg.resources.model.batch_visual_tokens)
        self._meter = _UsageMeter()

    def _sampling(self, rid: str):
        from vlbatch.operators.engine.request import SamplingParams

        s = self.cfg.sampling
        greedy = s.temperature == 0
        return SamplingParams(max_new_tokens=s.max_tokens, do_sample=not greedy,
                              temperature=1.0 if greedy else s.temperature, top_k=s.top_k,
                              top_p=None if s.top_p == 1.0 else s.top_p, seed=request_seed(s.seed, rid))

    def generate(self, rows: list[Prepared]) -> dict[str, ReqOut]:
        from vlbatch.operators.engine.request import Request

        out: dict[str, ReqOut] = {}
        reqs = []
        for r in rows:
            for i, rid in enumerate(r.ids):
                try:
                    reqs.append(Request.from_processor(rid, processor_dict(r, i), 0, sampling=self._sampling(rid),
                                                       group=r.media_uri, thinking=self.cfg.task.thinking))
                except InputError as e:
                    out[rid] = ReqOut(None, None, None, None, None, None, e.error_type, str(e))
        results = self.loop.run(reqs, visual_tokens=sum(r.visual_tokens for r in rows))
        for res in results.values():
            if res.finish_reason == "error":
                etype = res.error_type or "EngineError"
                out[res.id] = ReqOut(None, None, None, res.prompt_tokens, 0, res.cached_tokens, etype, res.error)
            else:
                out[res.id] = ReqOut(res.text, res.thinking, res.finish_reason, res.prompt_tokens,
                                     res.generated_tokens, res.cached_tokens)
        return out

    def take_usage(self) -> Usage:
        def read() -> Usage:
            s = self.engine.stats()
            return Usage(self.loop.busy_s, self.loop.busy_cpu_s, s["vision_cache_hits"], s["vision_encodes"])

        return self._meter.take(read)


class TransformersBackend:
    def __init__(self, cfg: JobConfig):
        import torch
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from vlbatch.operators.model.loader import torch_dtype

        self.cfg = cfg
        self.device = resolve_device(cfg.model.device)
        path = local_model_path(cfg)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype(cfg.model.dtype))
        self.model.to(self.device).eval()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.torch = torch
        self._lock = threading.Lock()  # one generate() at a time
        self._busy_s = 0.0
        self._meter = _UsageMeter()

    def generate(self, rows: list[Prepared]) -> dict[str, ReqOut]:
        out = {}
        with self._lock:
            t0 = time.perf_counter()
            try:
                for r in rows:
                    for i, rid in enumerate(r.ids):
                        out[rid] = self.generate_one(processor_dict(r, i), rid)
            finally:
                self._busy_s += time.perf_counter() - t0
        return out

    def take_usage(self) -> Usage:
        return self._meter.take(lambda: Usage(self._busy_s, self._busy_s))  # no vision cache counters

    def generate_one(self, inputs: dict[str, np.ndarray], rid: str) -> ReqOut:
        from vlbatch.operators.engine.request import split_thinking

        torch = self.torch
        s = self.cfg.sampling
        keep = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw")
        kw = {k: torch.as_tensor(v).to(self.device) for k, v in inputs.items() if k in keep}
        for k in ("pixel_values", "pixel_values_videos"):
            if k in kw:
                kw[k] = kw[k].to(self.model.dtype)
        gen = {"max_new_tokens": s.max_tokens, "do_sample": s.temperature > 0}
        if s.temperature > 0:
            torch.manual_seed(request_seed(s.seed, rid))
            gen.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        with torch.no_grad():
            seq = self.model.generate(**kw, **gen)
        L = kw["input_ids"].shape[1]
        new = seq[0, L:].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        finish = "stop" if new and new[-1] in eos else "length"
        text = self.tok.decode(new, skip_special_tokens=True)
        thinking = None
        if self.cfg.task.thinking:  # the engine's reading of the same output (`split_thinking`)
            thinking, text = split_thinking(text)
        return ReqOut(text, thinking, finish, L, len(new), 0)
