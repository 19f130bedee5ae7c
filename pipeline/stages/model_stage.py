"""The model stage: Prepared rows -> Generated rows on one model actor.

The actor holds one backend of `MODEL_BACKENDS` (`model.backend`; `engine`: vlbatch.operators.engine,
the product; `transformers`: reference `generate()`, used by the benchmark baseline). A Ray batch holds whole media
rows (all questions of a media together), so siblings meet the same actor's vision and
prefix caches. Ray Data runs up to `resources.model.max_concurrent_batches` calls at
once on an actor (threads); with the engine backend all of them feed one continuous
batch (`vlbatch.operators.engine.EngineLoop`), so a call returns as soon as its own requests are
done while the engine goes on with the others': small Ray batches (`batch_size` media)
commit early without draining the engine. What the engine holds is bounded by *visual
tokens* (`resources.model.batch_visual_tokens` in flight per actor), not rows.

The backend's per-request outcomes (engine `Result`s, or the typed error that kept a request
from being built) map straight to the output columns (`_columns`).

Errors: a request that cannot be built (bad shapes) is a permanent error row; an engine
failure turns every request it held into a transient `EngineError` row (retried on
resume), as does an exception from the backend for a whole call; rows in error pass through.
Out of memory (torch's `OutOfMemoryError`, `MemoryError`: from the backend or as the engine
loop's `Result.out_of_memory`) is not the requests' fault: the device's caches are freed and the
requests that ran out are run again in two halves, recursively (`_run`); only a request that
runs out alone becomes an `EngineError` row. Each split halves the batch, so a call makes at most
about 2n engine batches for n requests.

A call holds one Ray Data block (the runner maps the model stage with `batch_size=None`, so a
task is one block and its rows are handed on when it returns; `plan/spec.block_bytes` sizes blocks
to about `resources.model.batch_size` media); a block of more media is run as calls of
`batch_size` media at once on the same loop.

On the CPU the actor owns its process: it keeps freed step memory in the heap
(`engine/host_memory.py`) and, with the engine backend, has the compiled kernels built at the
SIMD width timed fastest on this machine (`operators/host_simd.py`, before anything defines one).

Progress (`meter`, `pipeline/telemetry/meter.py`): the actor says when its model is loaded, counts the
requests handed to it (`model_in`), and the engine backend counts each request as generated when the
engine finishes it. With the engine backend the actor reports its occupancy (`ModelReport`: engine
stepping and idle seconds over its window, from its first call; `pipeline/telemetry/occupancy.py`)
every second from a reporter thread and at the end of each call; with `metrics` (the run's
`MetricTags`, `ray.metrics`) it records each call's seconds and its busy fraction in Ray's metrics.

A `SetupError` (the job's checkpoint or device, not a request) fails the run instead.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace

import pyarrow as pa

from vlbatch.operators.errors import EngineError, SetupError, TruncatedError, VlbatchError, stable_message
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.config.model_backends import MODEL_BACKENDS
from vlbatch.pipeline.stages.model_place import resolve_device
from vlbatch.pipeline.stages.rows import Generated, Prepared, clip_fields, from_table, to_table
from vlbatch.pipeline.telemetry.meter import GENERATED, MODEL_READY, MeterClient
from vlbatch.pipeline.telemetry.metrics import MODEL_IN
from vlbatch.pipeline.telemetry.occupancy import ModelReport

# test hook (tests/test_metrics_busy.py): seconds added to every engine step, to make a model slow on purpose
STEP_DELAY_ENV = "VLBATCH_TEST_STEP_DELAY_S"

log = logging.getLogger("vlbatch.pipeline")


class ModelStage:
    """Ray actor UDF: numpy batch of Prepared rows -> table of Generated rows."""

    def __init__(self, cfg: JobConfig, meter=None, metrics=None):
        import torch

        from vlbatch.operators.host_simd import use_fastest_simd

        torch.set_num_threads(max(1, int(cfg.resources.model.num_cpus)))
        backend = MODEL_BACKENDS.load(cfg.model.backend)  # a class (pipeline/config/model_backends.py)
        if resolve_device(cfg.model.device) == "cpu":  # the actor owns its process: its heap and its SIMD width
            if getattr(backend, "compiled_kernels", False):  # before the engine defines its compiled kernels
                log.info(use_fastest_simd().describe())
            from vlbatch.operators.engine.host_memory import retain_freed_memory

            retain_freed_memory()
        self.cfg = cfg
        self.meter = MeterClient(meter)
        # with counts_finished, requests count as generated when the engine finishes them
        self.backend = backend(cfg, on_finished=lambda n: self.meter.add(GENERATED, n))
        if delay := os.environ.get(STEP_DELAY_ENV):
            slow_steps(self.backend.engine, float(delay))
        self.watch = ActorWatch(self.meter, getattr(self.backend, "loop", None), metrics)
        self.meter.ready(MODEL_READY)

    def __del__(self):  # Ray Data's graceful actor exit; frees a replica's followers
        if (watch := getattr(self, "watch", None)) is not None:
            watch.close()
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()

    def __call__(self, batch: pa.Table):  # may run on several threads at once (see the module docstring)
        t0 = self.watch.enter()
        rows = from_table(batch, Prepared)
        self.meter.add(MODEL_IN, sum(len(r.ids) for r in rows))
        n = self.cfg.resources.model.batch_size
        if len(rows) <= n:
            out = self._call(rows)
        else:  # a whole block (runner: one call per block): batch_size media per engine call, all at once
            from concurrent.futures import ThreadPoolExecutor

            chunks = [rows[i:i + n] for i in range(0, len(rows), n)]
            with ThreadPoolExecutor(len(chunks), thread_name_prefix="model-call") as pool:
                out = pa.concat_tables(list(pool.map(self._call, chunks)))
        if not getattr(self.backend, "counts_finished", False):  # the reference backend: counted per call
            self.meter.add(GENERATED, sum(len(r.ids) for r in rows if r.status == "ok"))
        self.meter.flush()
        self.watch.leave(t0, out)
        return out

    def _call(self, rows: list[Prepared]) -> pa.Table:
        live = [r for r in rows if r.status == "ok"]
        t0 = time.perf_counter()
        results = self._run(live) if live else {}
        dt = time.perf_counter() - t0
        # model work since the last take, on this call's first ok row (taken only when such a row exists)
        usage = self.backend.take_usage() if live else None
        out: list[Generated] = []
        for r in rows:
            if r.status != "ok":
                out.append(self._passthrough(r))
                continue
            g = self._generated(r, [results[rid] for rid in r.ids], dt)
            if r is live[0]:
                g = replace(g, vision_hits=usage.vision_cache_hits, vision_encodes=usage.vision_encodes,
                            batch_model_s=usage.busy_s, batch_model_cpu_s=usage.busy_cpu_s)
            out.append(g)
        return to_table(out, Generated)

    def _run(self, rows: list[Prepared]) -> dict[str, object]:
        """{request id: Result | error} for every request of `rows`: one engine batch, and the
        requests of it that ran out of memory run again in two halves (recursively) after the
        device's caches are freed; a request that runs out alone keeps its `EngineError`."""
        results, oom = self._generate(rows)
        if len(oom) <= 1:
            return results
        free_device_memory()
        half = len(oom) // 2
        for part in (oom[:half], oom[half:]):
            results.update(self._run(_rows_of(part)))
        return results

    def _generate(self, rows: list[Prepared]) -> tuple[dict[str, object], list[tuple[Prepared, int]]]:
        """One engine batch -> (its results, the (row, prompt index) of each request that ran out of
        memory); a backend exception becomes EngineError results for all of it."""
        try:
            results = self.backend.generate(rows)
        except SetupError:  # the job's own setup (checkpoint, device): fails the run, never rows
            raise
        except Exception as e:  # the whole batch failed (OOM, device error): transient
            err = e if isinstance(e, VlbatchError) else EngineError(f"{type(e).__name__}: {e}")
            results = {rid: err for r in rows for rid in r.ids}
            oom = _is_out_of_memory(e)
            return results, [(r, i) for r in rows for i in range(len(r.ids)) if oom]
        return results, [(r, i) for r in rows for i, rid in enumerate(r.ids)
                         if getattr(results[rid], "out_of_memory", False)]

    def _base(self, r: Prepared) -> dict:
        return {"media_uri": r.media_uri, "media_type": r.media_type, "ids": r.ids,
                "request_indices": r.request_indices, "prompts": r.prompts, "status": r.status,
                "error_type": r.error_type, "error_message": r.error_message,
                "decode_s": r.decode_s, "preprocess_s": r.preprocess_s, "keep": r.keep, "prompt_names": r.prompt_names,
                **clip_fields(r)}

    def _passthrough(self, r: Prepared) -> Generated:
        n = len(r.ids)
        return Generated(**self._base(r), answers=(None,) * n, thinking=(None,) * n, statuses=("error",) * n,
                         req_error_types=(r.error_type,) * n, req_error_messages=(r.error_message,) * n,
                         finish_reasons=(None,) * n, prompt_tokens=(None,) * n, generated_tokens=(None,) * n,
                         cached_tokens=(None,) * n, visual_tokens=r.visual_tokens)

    def _generated(self, r: Prepared, outs: list, model_s: float) -> Generated:
        cols = list(zip(*(_columns(o) for o in outs), strict=True))
        names = ("answers", "thinking", "finish_reasons", "prompt_tokens", "generated_tokens", "cached_tokens",
                 "req_error_types", "req_error_messages", "parsed")
        g = Generated(**self._base(r), visual_tokens=r.visual_tokens, model_s=model_s)
        return replace(g, **dict(zip(names, map(tuple, cols), strict=True)),
                       statuses=tuple("ok" if e is None else "error" for e in cols[6]))


class ActorWatch:
    """A model actor's occupancy and its metrics: the window opens at the first call; each call's end and a
    reporter thread (every `every_s`, also while the actor waits) send a `ModelReport` to the meter."""

    def __init__(self, meter: MeterClient, loop, metrics, every_s: float = 1.0, clock=time.perf_counter):
        self.meter, self.loop, self.every_s, self.clock = meter, loop, every_s, clock
        self.actor = os.urandom(4).hex()
        self.metrics = None
        if metrics is not None:
            from vlbatch.pipeline.telemetry.metrics import ModelMetrics

            self.metrics = ModelMetrics(metrics)
        self._lock = threading.Lock()
        self._since: float | None = None  # the first call's start
        self.rows = self.generated_tokens = 0
        self._done = (0.0, 0.0, 0.0)  # busy, idle, window at the end of the latest call
        self._stop = threading.Event()

    def enter(self) -> float:
        now = self.clock()
        with self._lock:
            if self._since is None:
                self._since = now
                if self.loop is not None:
                    threading.Thread(target=self._run, name="model-occupancy", daemon=True).start()
        return now

    def leave(self, t0: float, out: pa.Table) -> None:
        """One call ended: its latency, its rows and generated tokens, a report."""
        ok = sum(s == "ok" for v in out.column("statuses").to_pylist() for s in v or ())
        tokens = sum(x or 0 for v in out.column("generated_tokens").to_pylist() for x in v or ())
        with self._lock:
            self.rows += ok
            self.generated_tokens += tokens
            if self.loop is not None:
                self._done = (self.loop.busy_s, self.loop.idle_now(), self.clock() - self._since)
        if self.metrics is not None:
            self.metrics.call(self.clock() - t0)
        self.send()

    def send(self) -> None:
        if self.loop is None or self._since is None:
            return
        with self._lock:
            report = ModelReport(self.actor, self.loop.busy_s, self.loop.idle_now(), self.clock() - self._since,
                                 self.rows, self.generated_tokens, *self._done)
        self.meter.report(report)
        if self.metrics is not None and report.window_s > 0:
            self.metrics.busy_fraction(min(1.0, report.busy_s / report.window_s))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.send()

    def close(self) -> None:
        self._stop.set()


def slow_steps(engine, delay_s: float) -> None:
    """Test hook (`STEP_DELAY_ENV`): every engine step first sleeps `delay_s` (a slow model on purpose)."""
    step = engine.step

    def slow():
        time.sleep(delay_s)
        return step()

    engine.step = slow


def _is_out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, (torch.OutOfMemoryError, MemoryError))


def free_device_memory() -> None:
    """Before a retry after running out of memory: collect garbage and hand torch's cached CUDA
    blocks back (a no-op on the CPU)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _rows_of(requests: list[tuple[Prepared, int]]) -> list[Prepared]:
    """(row, prompt index) pairs -> one row per media holding only those prompts, in order."""
    by_row: dict[int, tuple[Prepared, list[int]]] = {}
    for row, i in requests:
        by_row.setdefault(id(row), (row, []))[1].append(i)
    return [row.only(tuple(idx)) for row, idx in by_row.values()]


def _columns(o) -> tuple:
    """One request's output columns (answer, thinking, finish_reason, prompt / generated / cached
    tokens, error type, error message, parsed) from its engine `Result` or the error that stopped it.
    A constrained answer cut by max_tokens is a `TruncatedError` row (its text kept, no parsed value)."""
    if isinstance(o, VlbatchError):
        return None, None, None, None, None, None, o.error_type, stable_message(str(o)), None
    if o.finish_reason == "error":
        error_type = o.error_type or "EngineError"
        return None, None, None, o.prompt_tokens, 0, o.cached_tokens, error_type, stable_message(o.error), None
    if getattr(o, "truncated", False):
        msg = (f"generation stopped ({o.finish_reason}, {o.generated_tokens} tokens) before the structured answer "
               "was complete; raise sampling.max_tokens")
        return (o.text, o.thinking, o.finish_reason, o.prompt_tokens, o.generated_tokens, o.cached_tokens,
                TruncatedError.__name__, msg, None)
    return (o.text, o.thinking, o.finish_reason, o.prompt_tokens, o.generated_tokens, o.cached_tokens, None, None,
            getattr(o, "parsed", None))
