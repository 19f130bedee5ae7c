"""The engine runs out of memory on a batch (issue 48): the model stage splits the batch in halves
and retries; only a request that still fails alone becomes an `EngineError` row.

The out-of-memory error is injected (no device here runs out on the tiny model): the real engine's
`step` raises torch's own `OutOfMemoryError` whenever it holds more than `K` sequences, or whenever it
holds the one request the test marks as too large to ever fit. Everything else is the real model
stage, engine loop and engine on the tiny checkpoint.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.stages.rows import Generated, MediaTask, from_table, to_table

K = 2  # the most sequences the injected memory budget lets the engine hold at once
TOO_BIG = "b1"  # a request that runs out of memory even alone


def _tasks(tmp_path) -> list[MediaTask]:
    from PIL import Image

    rng = np.random.default_rng(7)
    tasks = []
    for k in range(3):
        path = tmp_path / f"m{k}.png"
        Image.fromarray(rng.integers(0, 256, (32 + 8 * k, 48, 3), dtype=np.uint8)).save(path)
        tasks.append(MediaTask(str(path), "image", (f"a{k}", f"b{k}"), (0, 1), ("Describe.", "Colour?")))
    return tasks


def _cfg(tmp_path, ckpt):
    return validate_config({"model": {"path": str(ckpt), "dtype": "float32"}, "input": {"uri": "x"},
                            "output": {"uri": str(tmp_path / "o")}, "image": {"max_pixels": 16384},
                            "sampling": {"max_tokens": 5},
                            "resources": {"model": {"batch_size": 8, "batch_visual_tokens": 10**6}}})


def _inject_oom(engine, seen: list[int]) -> None:
    """engine.step raises OutOfMemoryError over the budget (K sequences) or with TOO_BIG inside."""
    step = engine.step

    def limited():
        held = [s.request.id for s in (*engine.scheduler.waiting, *engine.scheduler.running)]
        seen.append(len(held))
        if len(held) > K or TOO_BIG in held:
            raise torch.OutOfMemoryError(f"injected: {len(held)} sequences over a budget of {K}")
        return step()

    engine.step = limited


@pytest.mark.slow
def test_out_of_memory_splits_the_batch_and_fails_only_the_request_that_fails_alone(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.stages.model_stage import ModelStage
    from vlbatch.pipeline.stages.prepare import PrepareStage

    cfg = _cfg(tmp_path, tiny_ckpt("dense"))
    prepared = PrepareStage(cfg)(to_table(_tasks(tmp_path), MediaTask))
    clean = {rid: a for g in from_table(ModelStage(cfg)(prepared), Generated) for rid, a in zip(g.ids, g.answers, strict=True)}

    stage = ModelStage(cfg)
    seen: list[int] = []
    _inject_oom(stage.backend.engine, seen)
    got = from_table(stage(prepared), Generated)

    assert max(seen) > K, "the first batch held more than the budget (the injection fired)"
    rows = {rid: (g.statuses[i], g.answers[i], g.req_error_types[i], g.req_error_messages[i])
            for g in got for i, rid in enumerate(g.ids)}
    assert sorted(rows) == sorted(clean), "every request exactly once"
    for rid, (status, answer, etype, message) in rows.items():
        if rid == TOO_BIG:
            assert (status, etype) == ("error", "EngineError")
            assert "OutOfMemoryError" in message
        else:  # retried in smaller batches: the clean run's answers
            assert (status, answer) == ("ok", clean[rid]), rid
