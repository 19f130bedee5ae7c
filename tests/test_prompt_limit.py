"""`sampling.max_prompt_tokens` (issue 31 item 9): a request whose prompt (text and visual tokens)
is longer than the limit (default: the checkpoint's context length) is an `InputError` row that
the model never sees; the media's other requests are answered. The stages are called directly
(no Ray) on a tiny checkpoint and a real PNG, with both backends."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.stages.rows import Generated, MediaTask, Prepared, from_table, to_table

LONG = "Tell me about " + "the colour of this picture and " * 60 + "everything else?"


def _prepared(tmp_path, cfg):
    from PIL import Image

    from vlbatch.pipeline.stages.prepare import PrepareStage

    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(path)
    task = MediaTask(str(path), "image", ("short", "long"), (0, 1), ("Describe.", LONG))
    return PrepareStage(cfg)(to_table([task], MediaTask))


def _job(tmp_path, ckpt, backend: str, limit: int | None) -> dict:
    return {"model": {"path": str(ckpt), "dtype": "float32", "device": "cpu", "backend": backend},
            "input": {"uri": "x"}, "output": {"uri": str(tmp_path / "out")}, "image": {"max_pixels": 16384},
            "sampling": {"max_tokens": 4, "max_prompt_tokens": limit}}


@pytest.mark.parametrize("backend", ["engine", "transformers"])
@pytest.mark.parametrize("where", ["config", "context"])
def test_a_prompt_over_the_limit_is_an_input_error_row_without_model_time(tmp_path, tiny_ckpt, backend, where):
    from vlbatch.pipeline.backends.backends import prompt_limit
    from vlbatch.pipeline.stages.model_stage import ModelStage

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("dense"), ckpt)
    probe = validate_config(_job(tmp_path, ckpt, backend, None))
    assert prompt_limit(probe, str(ckpt)) == 262144  # the default: the checkpoint's context length
    short, long = (len(ids) for ids in from_table(_prepared(tmp_path, probe), Prepared)[0].input_ids)
    assert short < long
    limit = (short + long) // 2
    if where == "context":  # the default limit: a checkpoint of a short context
        conf = json.loads((ckpt / "config.json").read_text())
        conf["text_config"]["max_position_embeddings"] = limit
        (ckpt / "config.json").write_text(json.dumps(conf))
    cfg = validate_config(_job(tmp_path, ckpt, backend, limit if where == "config" else None))
    stage = ModelStage(cfg)
    (g,) = from_table(stage(_prepared(tmp_path, cfg)), Generated)
    assert g.statuses == ("ok", "error")
    assert g.answers[0] is not None and g.generated_tokens[0] >= 1
    assert g.req_error_types[1] == "InputError"
    msg = g.req_error_messages[1]
    assert f"the prompt is {long} tokens" in msg and f"limit of {limit}" in msg and "sampling.max_prompt_tokens" in msg
    assert g.prompt_tokens[1] is None and g.generated_tokens[1] is None  # the model never saw it
    if backend == "engine":
        assert stage.backend.engine.stats()["prefill_tokens"] <= short  # only the short prompt was prefilled
    stage.backend.close()
