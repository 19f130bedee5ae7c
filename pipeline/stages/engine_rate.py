"""Scan mode's engine rate (issue 53): how many requests/s the job's model does on this hardware, and so
how many CPU cores of decode + preprocess keep one model replica busy.

After a scan, `scan_engine_rate(cfg, summary)` takes the scan's measured token shape (`TokenShape`: the mean
prompt and visual tokens of its ok requests, `sampling.max_tokens` generated each, an upper bound: a scan
generates nothing) and times the job's engine on `N_REQUESTS` synthetic requests of that shape, submitted
together (one continuous batch), in a Ray task with the model pool's resources (a GPU model is timed on a
GPU; a cluster without them is said, never waited on). The rate is kept in `~/.cache/vlbatch/engine_rate.json`
per machine, model, device, dtype and shape (`rate_key`), like the SIMD probe's choice (`host_simd.py`), so
a second scan reuses it. `cores_text` is the arithmetic: cores = CPU s per request x requests/s.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = "~/.cache/vlbatch/engine_rate.json"
RATE_VERSION = 1  # part of the key: raise it when the synthetic workload changes
N_REQUESTS = 8


@dataclass(frozen=True)
class TokenShape:
    """A scan's mean request: prompt tokens (visual placeholders included), visual tokens, tokens generated."""

    prompt_tokens: int
    visual_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class EngineRate:
    """`requests` synthetic requests of a shape done in `seconds`; `source`: measured | cached."""

    requests_per_s: float
    requests: int
    seconds: float
    source: str


def token_shape(summary, max_tokens: int) -> TokenShape | None:
    """The mean ok request of a scan's `RunSummary` (None: no ok request, nothing to time)."""
    ok = summary.processed_by_status.get("ok", 0)
    if not ok or summary.prompt_tokens <= 0:
        return None
    return TokenShape(max(1, round(summary.prompt_tokens / ok)), round(summary.visual_tokens / ok), max_tokens)


def cores_text(cpu_s_per_request: float, rate: EngineRate, shape: TokenShape) -> str:
    """The scan's busy line: the model's rate here and the decode + preprocess cores that keep it busy."""
    cores = cpu_s_per_request * rate.requests_per_s
    return (f"the model does {rate.requests_per_s:.2f} requests/s here ({rate.source}: {rate.requests} synthetic "
            f"requests of {shape.prompt_tokens} prompt / {shape.visual_tokens} visual tokens, {shape.max_tokens} "
            f"generated each, in {rate.seconds:.2f} s); keeping it busy needs about {cores:.2f} CPU cores of "
            f"decode+preprocess per replica")


def rate_key(model_dir: str, device: str, dtype: str, shape: TokenShape) -> str:
    """What a measured rate is valid for: this machine (host, CPU, GPU), the checkpoint's files, the device,
    dtype and token shape."""
    gpu = ""
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device))
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in Path(model_dir).iterdir()
                   if p.is_file())
    digest = hashlib.sha256(json.dumps([str(Path(model_dir).resolve()), files]).encode()).hexdigest()[:16]
    return (f"v{RATE_VERSION}|{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()}|{gpu}"
            f"|{digest}|{device}|{dtype}|{shape.prompt_tokens}/{shape.visual_tokens}/{shape.max_tokens}")


def cached_rate(key: str, cache: Path) -> EngineRate | None:
    try:
        got = json.loads(cache.read_text()).get(key)
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict):
        return None
    return EngineRate(float(got["requests_per_s"]), int(got["requests"]), float(got["seconds"]), "cached")


def keep_rate(key: str, rate: EngineRate, cache: Path) -> None:
    """Add `rate` to the cache file (written whole, then renamed: never half a file)."""
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    table = table if isinstance(table, dict) else {}
    table[key] = {"requests_per_s": rate.requests_per_s, "requests": rate.requests, "seconds": rate.seconds}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, cache)


def synthetic_requests(model_dir: str, shape: TokenShape, n: int) -> list:
    """`n` requests of about `shape`: a distinct noise image each (no prefix or vision cache hit between
    them) of about `visual_tokens`, text padded to about `prompt_tokens`, `max_tokens` generated (no stop)."""
    import numpy as np

    from vlbatch.operators.engine.request import Request, SamplingParams
    from vlbatch.operators.preprocess import Processor

    proc = Processor.from_pretrained(model_dir)
    factor = proc.image_config.patch_size * proc.spatial_merge_size
    side = max(1, math.ceil(math.sqrt(max(shape.visual_tokens, 1)))) * factor
    sampling = SamplingParams(max_new_tokens=shape.max_tokens, stop_token_ids=())
    out = []
    for i in range(n):
        image = np.random.default_rng(i).integers(0, 256, (side, side, 3), dtype=np.uint8)
        pad = max(0, shape.prompt_tokens - shape.visual_tokens - 16)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a " * pad + "Describe."}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
        out.append(Request.from_processor(f"rate{i}", proc(text, images=[image]), 0, sampling=sampling))
    return out


def time_engine(engine, requests: list, warm) -> EngineRate:
    """Run `requests` through `engine` together, after one `warm` request of its own (compiles, allocates)."""
    list(engine.generate([warm]))
    t0 = time.perf_counter()
    done = list(engine.generate(requests))
    seconds = time.perf_counter() - t0
    return EngineRate(len(done) / seconds, len(done), seconds, "measured")


def measure_rate(cfg, shape: TokenShape, cache_file: str = DEFAULT_CACHE) -> EngineRate:
    """The job's engine rate on this machine for `shape`: cached, else timed and kept (runs where the model
    would: in the Ray task `scan_busy` starts, or in a test's process)."""
    from vlbatch.operators.factory import load_engine
    from vlbatch.pipeline.stages.model_place import local_model_path, resolve_device

    device, model_dir = resolve_device(cfg.model.device), local_model_path(cfg)
    cache = Path(cache_file).expanduser()
    key = rate_key(model_dir, device, cfg.model.dtype, shape)
    got = cached_rate(key, cache)
    if got is not None:
        return got
    engine = load_engine(model_dir, device=device, dtype=cfg.model.dtype, **cfg.model.engine.engine_kwargs())
    *requests, warm = synthetic_requests(model_dir, shape, N_REQUESTS + 1)
    rate = time_engine(engine, requests, warm)
    keep_rate(key, rate, cache)
    return rate


def scan_busy(cfg, summary, cpu_s_per_request: float | None, cache_file: str = DEFAULT_CACHE) -> str | None:
    """In the driver after a scan: the busy line (`cores_text`), why the rate was not measured, or None (no
    ok request or no CPU cost measured: nothing to say)."""
    import ray

    shape = token_shape(summary, cfg.sampling.max_tokens)
    if shape is None or not cpu_s_per_request:
        return None
    if cfg.model.backend != "engine" or cfg.model.tensor_parallel_size > 1:
        return "engine rate not measured: only for model.backend engine with tensor_parallel_size 1"
    res = cfg.resources.model
    have = ray.cluster_resources()
    short = [f"{v:g} {k}" for k, v in (("CPU", res.num_cpus), ("GPU", res.num_gpus)) if v and have.get(k, 0) < v]
    if short:  # a task asking for what the cluster lacks would wait forever
        return f"engine rate not measured: the cluster has fewer than the model pool's {' and '.join(short)}"
    task = ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_retries=0)(measure_rate)
    try:
        rate = ray.get(task.remote(cfg, shape, cache_file))
    except Exception as e:  # noqa: BLE001 - the scan's rows are committed; the estimate is extra
        cause = getattr(e, "cause", None) or e
        return f"engine rate not measured: {type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
    return cores_text(cpu_s_per_request, rate, shape)
