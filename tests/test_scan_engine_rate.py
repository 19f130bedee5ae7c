"""Issue 53: scan mode measures the job's engine rate here and says how many CPU cores of decode + preprocess
keep a model replica busy (`pipeline/stages/engine_rate.py`). The arithmetic at unit level; the measurement
and its per-machine cache on a tiny checkpoint; the line printed by a real scan (the session's Ray).

The engine is timed for real twice in the module, each once: in this process (`measure_rate`, the cache's
test: a second shape's entry is already kept, as a measurement of it leaves one) and in the scan's Ray task
(the scan's "measured" line). Both write a cache file of the test's own, never the user's ~/.cache."""
from __future__ import annotations

import functools
import io
import json

import pytest

from vlbatch.pipeline.stages.engine_rate import EngineRate, TokenShape, cores_text, token_shape
from vlbatch.pipeline.stages.scan import cpu_s_per_request, scan_line
from vlbatch.pipeline.telemetry.summary import RunSummary


def test_cores_are_cpu_seconds_per_request_times_the_engines_rate():
    s = RunSummary("r", "o", 0, 0, processed_by_status={"ok": 4, "error": 1}, prompt_tokens=402, visual_tokens=144,
                   stage_seconds={"decode": 0.3, "preprocess": 0.2})
    assert cpu_s_per_request(s) == pytest.approx(0.1)  # 0.5 CPU s over 5 requests (error rows cost too)
    shape = token_shape(s, 64)
    assert shape == TokenShape(prompt_tokens=100, visual_tokens=36, max_tokens=64)  # means over the 4 ok
    assert token_shape(RunSummary("r", "o", 0, 0, processed_by_status={"error": 3}), 64) is None
    line = cores_text(0.1, EngineRate(12.5, 8, 0.64, "measured"), shape)
    assert line.startswith("the model does 12.50 requests/s here (measured: 8 synthetic requests of 100 prompt / 36 "
                           "visual tokens, 64 generated each, in 0.64 s)")
    assert line.endswith("keeping it busy needs about 1.25 CPU cores of decode+preprocess per replica")
    assert scan_line(s, busy=line).endswith("; " + line) and scan_line(s).count("the model does") == 0


def test_the_rate_is_measured_once_per_machine_and_model_then_cached(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.stages.engine_rate import N_REQUESTS, keep_rate, measure_rate, rate_key
    from vlbatch.pipeline.stages.model_place import local_model_path, resolve_device

    cfg = JobConfig.model_validate({"model": {"path": str(tiny_ckpt("dense"))}, "input": {"uri": str(tmp_path)},
                                    "output": {"uri": str(tmp_path / "o")}, "task": {"mode": "scan"}})
    cache = tmp_path / "cache" / "engine_rate.json"
    shape = TokenShape(prompt_tokens=40, visual_tokens=16, max_tokens=4)
    # another shape of the same model and machine already kept (as its measurement leaves it): one timing
    # here, not two; the other shape's entry is neither taken for this one nor lost
    other_shape = TokenShape(40, 16, 6)
    other_key = rate_key(local_model_path(cfg), resolve_device(cfg.model.device), cfg.model.dtype, other_shape)
    keep_rate(other_key, EngineRate(3.5, N_REQUESTS, N_REQUESTS / 3.5, "measured"), cache)
    before = json.loads(cache.read_text())
    first = measure_rate(cfg, shape, str(cache))
    assert first.source == "measured" and first.requests == N_REQUESTS and first.requests_per_s > 0
    table = json.loads(cache.read_text())
    assert len(table) == 2 and table[other_key] == before[other_key]  # this shape: timed, kept beside
    (key,) = set(table) - {other_key}
    assert "40/16/4" in key and str(tiny_ckpt("dense").resolve()) not in key  # the path is in the digest
    assert key.replace("40/16/4", "40/16/6") == other_key  # the same machine, model, device, dtype
    again = measure_rate(cfg, shape, str(cache))
    assert again == EngineRate(first.requests_per_s, first.requests, first.seconds, "cached")
    other = measure_rate(cfg, other_shape, str(cache))  # the other shape: its own entry
    assert other == EngineRate(3.5, N_REQUESTS, N_REQUESTS / 3.5, "cached")


@pytest.mark.ray
def test_a_scan_prints_the_engine_rate_and_the_cores_that_keep_the_model_busy(two_cpu_ray, tmp_path, tiny_ckpt,
                                                                              monkeypatch):
    from PIL import Image

    from vlbatch.pipeline import graph
    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.graph import run_job
    from vlbatch.pipeline.stages.engine_rate import scan_busy

    # the scan's rate kept in a cache file of the test's own (the product's `cache_file`), not the user's
    # ~/.cache/vlbatch/engine_rate.json: the worker that times it is on this machine; a fresh file, so
    # the scan times the engine for real
    cache = tmp_path / "cache" / "engine_rate.json"
    monkeypatch.setattr(graph, "scan_busy", functools.partial(scan_busy, cache_file=str(cache)))

    for i in range(3):
        Image.new("RGB", (64, 48), (200, 10 * i, 10)).save(tmp_path / f"m{i}.png")
    cfg = JobConfig.model_validate({
        "model": {"path": str(tiny_ckpt("dense"))}, "input": {"uri": str(tmp_path / "*.png"), "format": "glob"},
        "output": {"uri": str(tmp_path / "out")}, "task": {"mode": "scan"}, "sampling": {"max_tokens": 4},
        "image": {"max_pixels": 65536},
        "resources": {"preprocess": {"num_cpus": 0.5, "max_actors": 1}, "model": {"num_cpus": 1}}})
    out = io.StringIO()
    s = run_job(cfg, stream=out)
    line = out.getvalue().strip().splitlines()[-1]
    assert line.startswith("vlbatch scan: 3 requests, 0 errors"), line
    assert "; the model does " in line and " requests/s here (measured: 8 synthetic requests of " in line, line
    assert line.endswith("CPU cores of decode+preprocess per replica"), line
    kept = json.loads(cache.read_text())  # the worker's machine is this one
    assert any(k.endswith("/4") for k in kept)  # this scan's shape, 4 tokens generated each
    # a model pool asking for a GPU the cluster lacks: said, never waited on
    gpu = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={
        "model": cfg.resources.model.model_copy(update={"num_gpus": 1})})})
    said = scan_busy(gpu, s, 0.01)
    assert said == "engine rate not measured: the cluster has fewer than the model pool's 1 GPU", said
