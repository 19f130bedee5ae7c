"""Model backends behind the model stage. Contract (both implementations):

    backend.generate(rows: list[Prepared]) -> dict[request_id, Result | VlbatchError]

covers every request of every row: the engine's `Result` (possibly an error result), or
the typed error that kept the request from being built; greedy when
`sampling.temperature == 0`; it may be called from several threads at once (the model
stage runs concurrent calls on one actor). `backend.take_usage() -> Usage` gives the
model's busy seconds and vision-tower counters since the previous take (so the figures
of all calls sum to the actor's totals). `backend.close()` releases what it holds (the
engine's thread; a tensor-parallel replica's followers and placement group).

A row's resized uint8 frames are read once (a tensor over the Arrow buffer, never copied per
question) and turned into normalised patches on the model's device with the checkpoint's
table and patch layout (`pixel_specs`, `operators/preprocess/shipped.py`). A deferred video
(`video.decode_device`: cuda / model-cpu) is decoded here first, by its shipped plan, on the
model's GPU (or CPU), into the same frames (`shared_pixels`).

- `EngineBackend`: vlbatch.operators.engine (paged KV, prefix and vision caches) behind an
  `EngineLoop`: every call's requests join one continuous batch: the product. All requests
  of a media share one pixel tensor and the CPU stage's content hash. With
  `model.tensor_parallel_size` > 1 the engine is rank 0's of a `pipeline/backends/followers.py` replica.
- `TransformersBackend`: transformers' `generate()`, one request at a time, calls
  serialised: the reference and the benchmark baseline (no caches, slow); it normalises
  a media's frames once (float32 patches, the processor's values) for all its questions.
"""
from __future__ import annotations

import hashlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlbatch.operators.errors import InputError, MediaError, VlbatchError
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.stages.model_place import local_model_path, resolve_device
from vlbatch.pipeline.stages.rows import Prepared

if TYPE_CHECKING:
    import torch

    from vlbatch.operators.preprocess.shipped import PixelSpec


def request_seed(base: int, rid: str) -> int:
    return (int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16) ^ base) & 0x7FFFFFFF


def pixel_specs(model_dir: str) -> dict[str, PixelSpec]:
    from vlbatch.operators.preprocess.shipped import pixel_specs as specs

    return specs(model_dir)


def shared_pixels(row: Prepared, spec: PixelSpec, decode_device: str = "cpu") -> torch.Tensor:
    """uint8 [F, H, W, 3] tensor over the row's Arrow buffer (no copy; it is only ever read), or for
    a deferred video its frames decoded on `decode_device` and resized as the CPU stage would have
    (`DecodePlan.frames`; `MediaError` for a file that does not decode to its plan)."""
    import torch

    if row.deferred:
        from vlbatch.operators.errors import MediaError
        from vlbatch.operators.preprocess.shipped import DecodePlan

        plan = DecodePlan.of(row.plan_indices, row.plan_total_frames, row.grid_thw, spec.layout)
        try:
            return plan.frames(row.media_bytes, decode_device)
        except VlbatchError:
            raise
        except Exception as e:  # FFmpeg / NVDEC text from TorchCodec: still a typed, per-file error
            raise MediaError(f"{row.media_uri}: decoder failed: {type(e).__name__}: {str(e)[:300]}") from e
    with warnings.catch_warnings():  # the buffer is read-only; torch warns about writes never made
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(row.pixels)


def prompt_limit(cfg: JobConfig, model_dir: str) -> int:
    """Most prompt tokens of one request: `sampling.max_prompt_tokens`, else the checkpoint's context
    length (`max_position_embeddings` of its text config)."""
    if cfg.sampling.max_prompt_tokens is not None:
        return cfg.sampling.max_prompt_tokens
    from vlbatch.operators.model.config import ModelConfig

    return ModelConfig.from_pretrained(model_dir).text.max_position_embeddings


def check_prompt_length(row: Prepared, i: int, limit: int | None) -> None:
    """`InputError` (permanent: the request itself is too long) when prompt `i` of `row` holds more
    than `limit` tokens (its text and the media's visual tokens)."""
    n = len(row.input_ids[i])
    if limit is not None and n > limit:
        raise InputError(f"{row.media_uri}: the prompt is {n} tokens (text and the {row.media_type}'s visual "
                         f"tokens), over the limit of {limit} (sampling.max_prompt_tokens; default: the model's "
                         "context length)")


def media_requests(row: Prepared, spec: PixelSpec, sampling, thinking: bool,
                   max_prompt_tokens: int | None = None, decode_device: str = "cpu",
                   formats: dict | None = None) -> dict[str, object]:
    """{request id: engine `Request` (or the `InputError` that refused it)} for every prompt of
    `row`, all around one pixel tensor and the row's content hash (prompts with equal spans
    share one `MediaItem`). `sampling(rid)` gives a request's SamplingParams; a prompt over
    `max_prompt_tokens` is refused (`check_prompt_length`), never given to the engine; a deferred
    video that fails to decode (`shared_pixels`) is its error for every prompt. `formats`:
    {prompt_name: engine `ResponseFormat`} (`response_formats`), the constrained prompts of the task."""
    import numpy as np
    import torch

    from vlbatch.operators.engine import MediaItem, Request

    try:
        pixels = shared_pixels(row, spec, decode_device)
    except (InputError, MediaError) as e:  # the media's own fault: permanent error rows
        return {rid: e for rid in row.ids}
    items: dict[tuple, MediaItem] = {}
    out: dict[str, object] = {}
    for i, rid in enumerate(row.ids):
        try:
            check_prompt_length(row, i, max_prompt_tokens)
            spans = row.prompt_spans(i)
            if spans not in items:
                items[spans] = MediaItem(row.media_type, pixels, tuple(row.grid_thw), spans, spec,
                                         content_hash=row.content_hash)
            pos = torch.from_numpy(np.array(row.prompt_positions(i), np.int64))  # [3, L_i], its own (small) copy
            out[rid] = Request(id=rid, prompt_token_ids=row.input_ids[i], position_ids=pos,
                               rope_delta=row.rope_deltas[i], media=(items[spans],), sampling=sampling(rid),
                               group=row.media_uri, thinking=thinking,
                               response_format=(formats or {}).get(row.prompt_names[i]))
        except InputError as e:  # bad shapes / spans: permanent
            out[rid] = e
    return out


def response_formats(cfg: JobConfig) -> dict:
    """{prompt_name: engine `ResponseFormat`} of the task's constrained prompts (questions, caption)."""
    from vlbatch.operators.engine.request import ResponseFormat

    return {name: ResponseFormat(kind, spec, name) for name, (kind, spec) in cfg.task.prompt_formats().items()}


def decode_device(cfg: JobConfig) -> str:
    """Where the model stage decodes deferred videos (`video.decode_device`: cuda -> the model's
    CUDA device, model-cpu -> its CPU); "cpu" when the CPU stage decodes them (nothing deferred).
    `SetupError` (the run fails, in one line) when this actor cannot decode there: `validate` checked
    the driver's machine, this is the model actor's."""
    from vlbatch.operators.errors import SetupError
    from vlbatch.operators.media.gpu_decode import DEFERRED, decode_device_problem

    wanted = cfg.video.decode_device
    if wanted in DEFERRED and (why := decode_device_problem(wanted, resolve_device(cfg.model.device))):
        raise SetupError(f"video.decode_device: {why}")
    return DEFERRED.get(wanted, "cpu")


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


def transformers_problem(here) -> str | None:
    """The transformers backend needs the transformers package (`MODEL_BACKENDS`' check)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed: pip install transformers"
    return None


class EngineBackend:
    counts_finished = True  # calls on_finished(n) as the engine finishes requests
    compiled_kernels = True  # runs our compiled CPU kernels (the model stage sets the SIMD width first)

    def __init__(self, cfg: JobConfig, on_finished=None):
        from vlbatch.operators.engine import EngineLoop
        from vlbatch.operators.factory import load_engine

        self.cfg = cfg
        kw = {"device": resolve_device(cfg.model.device), "dtype": cfg.model.dtype, **cfg.model.engine.engine_kwargs()}
        model_dir = local_model_path(cfg)  # once: for s3:// it lists (and maybe fetches) the checkpoint
        self.replica = None
        if cfg.model.tensor_parallel_size > 1:  # this actor is rank 0 of a replica (pipeline/backends/followers.py)
            from vlbatch.pipeline.backends.followers import Followers

            self.replica = Followers(cfg, model_dir, kw)
            self.engine = self.replica.engine
        else:
            self.engine = load_engine(model_dir, **kw)
        self.loop = EngineLoop(self.engine, max_visual_tokens=cfg.resources.model.batch_visual_tokens,
                               on_finished=on_finished)
        self.specs = pixel_specs(model_dir)
        self.max_prompt_tokens = prompt_limit(cfg, model_dir)
        self.decode_device = decode_device(cfg)
        self.formats = response_formats(cfg)
        self._meter = _UsageMeter()

    def _sampling(self, rid: str):
        from vlbatch.operators.engine.request import SamplingParams

        s = self.cfg.sampling
        greedy = s.temperature == 0
        return SamplingParams(max_new_tokens=s.max_tokens, do_sample=not greedy,
                              temperature=1.0 if greedy else s.temperature, top_k=s.top_k,
                              top_p=None if s.top_p == 1.0 else s.top_p, seed=request_seed(s.seed, rid))

    def generate(self, rows: list[Prepared]) -> dict[str, object]:
        out: dict[str, object] = {}
        for r in rows:
            out.update(media_requests(r, self.specs[r.media_type], self._sampling, self.cfg.task.thinking,
                                      self.max_prompt_tokens, self.decode_device, self.formats))
        reqs = [q for q in out.values() if not isinstance(q, VlbatchError)]
        out.update(self.loop.run(reqs))  # visual tokens: each media once (`pinned_visual_tokens`)
        return out

    def take_usage(self) -> Usage:
        def read() -> Usage:
            s = self.engine.stats()
            return Usage(self.loop.busy_s, self.loop.busy_cpu_s, s["vision_cache_hits"], s["vision_encodes"])

        return self._meter.take(read)

    def close(self) -> None:
        self.loop.close()
        if self.replica is not None:
            self.replica.close()


class TransformersBackend:
    counts_finished = False
    compiled_kernels = False

    def __init__(self, cfg: JobConfig, on_finished=None):  # on_finished: unused (counted per call)
        import torch
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from vlbatch.operators.model.loader import checkpoint_files, torch_dtype

        self.cfg = cfg
        self.device = resolve_device(cfg.model.device)
        path = local_model_path(cfg)
        checkpoint_files(path)  # safetensors or nothing (CheckpointError): a pickle is never opened
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype(cfg.model.dtype),
                                                                 use_safetensors=True)
        self.model.to(self.device).eval()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.specs = pixel_specs(path)
        self.max_prompt_tokens = prompt_limit(cfg, path)
        self.decode_device = decode_device(cfg)
        self.torch = torch
        self._lock = threading.Lock()  # one generate() at a time
        self._busy_s = 0.0
        self._meter = _UsageMeter()

    def generate(self, rows: list[Prepared]) -> dict[str, object]:
        out = {}
        with self._lock:
            t0 = time.perf_counter()
            try:
                for r in rows:
                    out.update(self.generate_media(r))
            finally:
                self._busy_s += time.perf_counter() - t0
        return out

    def take_usage(self) -> Usage:
        return self._meter.take(lambda: Usage(self._busy_s, self._busy_s))  # no vision cache counters

    def close(self) -> None:
        pass

    def generate_media(self, row: Prepared) -> dict[str, object]:
        """Every prompt of one media; its frames become normalised patches once (float32, the
        processor's values bit for bit), moved to the device once."""
        from vlbatch.operators.model.pixels import normalize_frames

        torch = self.torch
        spec = self.specs[row.media_type]
        patch, merge, temporal = spec.layout
        try:
            frames = shared_pixels(row, spec, self.decode_device)
        except (InputError, MediaError) as e:  # a deferred video that does not decode: its error rows
            return {rid: e for rid in row.ids}
        pixels = normalize_frames(frames, spec.table, patch=patch, merge=merge,
                                  temporal=temporal).to(self.device, self.model.dtype)
        grid = torch.tensor([row.grid_thw], dtype=torch.long, device=self.device)
        pv_key, grid_key = (("pixel_values", "image_grid_thw") if row.media_type == "image"
                            else ("pixel_values_videos", "video_grid_thw"))
        type_id = 1 if row.media_type == "image" else 2
        out: dict[str, object] = {}
        for i, rid in enumerate(row.ids):
            try:
                check_prompt_length(row, i, self.max_prompt_tokens)
            except InputError as e:  # never given to the model
                out[rid] = e
                continue
            ids = torch.tensor([row.input_ids[i]], dtype=torch.long)
            types = torch.zeros_like(ids)
            for s, e in row.prompt_spans(i):
                types[0, s:e] = type_id
            kw = {"input_ids": ids.to(self.device), "attention_mask": torch.ones_like(ids).to(self.device),
                  "mm_token_type_ids": types.to(self.device), pv_key: pixels, grid_key: grid}
            out[rid] = self.generate_one(kw, rid, row.visual_tokens)
        return out

    def generate_one(self, kw: dict, rid: str, visual_tokens: int):
        from vlbatch.operators.engine.request import Result, Timings, split_thinking

        torch = self.torch
        s = self.cfg.sampling
        gen = {"max_new_tokens": s.max_tokens, "do_sample": s.temperature > 0}
        if s.temperature > 0:
            torch.manual_seed(request_seed(s.seed, rid))
            gen.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        t0 = time.perf_counter()
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
        dt = time.perf_counter() - t0
        return Result(id=rid, token_ids=tuple(new), text=text, thinking=thinking, finish_reason=finish,
                      prompt_tokens=L, visual_tokens=visual_tokens, generated_tokens=len(new), cached_tokens=0,
                      timings=Timings(0.0, dt, dt))
