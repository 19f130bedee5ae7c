"""Caption and questions in one job (issue 33): `task.mode: questions` with `task.caption: true`
gives one row per (media, prompt), the caption after the questions; all of a media's prompts
share one decode, one preprocess and the prefix cache. A field the mode does not use is a
config error naming it. Stages are called directly (no Ray) on a tiny checkpoint and real media."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import TaskSection, load_config, validate_config
from vlbatch.pipeline.stages.requests import expand, request_id
from vlbatch.pipeline.stages.rows import Generated, MediaTask, Prepared, from_table, to_table

MIN = {"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": "o"}}


@pytest.mark.parametrize(("task", "columns", "field"), [
    ({"questions": ["a?"]}, {}, "task.questions"),
    ({}, {"questions": "qs"}, "input.columns.questions"),
    ({"caption": True}, {}, "task.caption"),
    ({"mode": "questions", "questions": ["a?"], "prompt": "Describe."}, {}, "task.prompt"),
    ({"mode": "questions", "questions": ["a?"], "video_prompt": "What happens?"}, {}, "task.video_prompt"),
])
def test_a_field_the_mode_does_not_use_is_an_error_naming_it(task, columns, field):
    cfg = {**MIN, "task": task, "input": {"uri": "x", "columns": columns}}
    with pytest.raises(ConfigError, match=rf"\n  {field}: not used by task.mode="):
        validate_config(cfg)


def test_fields_a_mode_uses_are_fine_and_null_unsets_a_prompt(tmp_path):
    both = validate_config({**MIN, "task": {"mode": "questions", "questions": ["a?"], "caption": True,
                                            "prompt": "Describe.", "video_prompt": "What happens?"}})
    assert both.task.caption and both.task.prompt == "Describe."
    scan = validate_config({**MIN, "task": {"mode": "scan", "questions": ["a?"], "prompt": "Describe."}})
    assert scan.task.question_prompts() == ["a?"]
    p = tmp_path / "job.yaml"
    p.write_text("model: {path: m}\ninput: {uri: x}\noutput: {uri: o}\ntask: {prompt: Describe.}\n")
    asked = load_config(p, ["task.mode=questions", "task.questions=['a?']", "task.prompt=null"])
    assert asked.task.mode == "questions" and "prompt" not in asked.task.model_fields_set


def test_caption_rides_after_the_questions_with_the_questions_ids_unchanged():
    qs = ("What colour?", "How many?")
    only = expand("a/x.png", None, None, TaskSection(mode="questions", questions=qs))
    both = expand("a/x.png", None, None, TaskSection(mode="questions", questions=qs, caption=True, prompt="Describe."))
    assert both.prompts == (*qs, "Describe.") and both.request_indices == (0, 1, 2)
    assert both.ids[:2] == only.ids and both.ids[2] == request_id("a/x.png", 2, "Describe.")
    video = expand("a/v.mp4", None, ["Why?"], TaskSection(mode="questions", caption=True, video_prompt="What happens?"))
    assert video.prompts == ("Why?", "What happens?") and video.status == "ok"
    none_asked = expand("a/x.png", None, [], TaskSection(mode="questions", caption=True, prompt="Describe."))
    assert none_asked.prompts == ("Describe.",) and none_asked.status == "ok"  # the caption alone, no error
    scan = expand("a/x.png", None, None, TaskSection(mode="scan", questions=qs, caption=True, prompt="Describe."))
    assert scan.prompts == (*qs, "Describe.")


def test_a_video_gets_a_video_caption_prompt_unless_the_config_sets_one():
    """Issue 60 item 13: neither prompt set, a video was captioned "Describe this image in detail."."""
    for task in (TaskSection(mode="questions", questions=("Why?",), caption=True), TaskSection()):
        video, image = expand("a/v.mp4", None, None, task), expand("a/x.png", None, None, task)
        assert video.prompts[-1] == "Describe this video in detail.", task
        assert image.prompts[-1] == "Describe this image in detail.", task
    asked = TaskSection(mode="questions", questions=("Why?",), caption=True, prompt="Describe.")
    assert expand("a/v.mp4", None, None, asked).prompts == ("Why?", "Describe.")  # task.prompt set: every media's
    assert expand("a/v.mp4", None, None, validate_config({**MIN, "task": {"prompt": None}}).task).prompts == \
        ("Describe this video in detail.",)  # `prompt: null` is not set


def test_one_decode_one_preprocess_and_the_prefix_for_caption_and_questions(tmp_path, tiny_ckpt):
    from PIL import Image

    from vlbatch.pipeline.plan.spec import requests_per_media
    from vlbatch.pipeline.stages.model_stage import ModelStage
    from vlbatch.pipeline.stages.prepare import PrepareStage

    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(path)
    cfg = validate_config({"model": {"path": str(tiny_ckpt("dense")), "dtype": "float32", "device": "cpu"},
                           "input": {"uri": "x"}, "output": {"uri": str(tmp_path / "out")},
                           "image": {"max_pixels": 16384}, "sampling": {"max_tokens": 4},
                           "task": {"mode": "questions", "questions": ["What colour?", "How many?"], "caption": True,
                                    "prompt": "Describe."}})
    assert requests_per_media(cfg) == 3
    task = expand(str(path), None, None, cfg.task)
    (prep,) = from_table(PrepareStage(cfg)(to_table([task], MediaTask)), Prepared)
    assert prep.status == "ok" and len(prep.input_ids) == 3  # one decode, one preprocess: one row, three prompts
    stage = ModelStage(cfg)
    (g,) = from_table(stage(to_table([prep], Prepared)), Generated)
    assert g.statuses == ("ok", "ok", "ok") and g.prompts[2] == "Describe."
    assert all(a is not None for a in g.answers)
    assert stage.backend.engine.stats()["vision_encodes"] == 1  # the media through the tower once
    # the media's tokens are prefilled once: the prompts after the first find them in the prefix cache
    media_end = prep.prompt_spans(0)[-1][1]  # system turn + media: the same tokens in all three prompts
    total = sum(len(ids) for ids in prep.input_ids)
    assert stage.backend.engine.stats()["prefill_tokens"] <= total - 2 * media_end
    stage.backend.close()


@pytest.mark.ray
def test_cli_run_of_a_folder_with_caption_and_questions(tmp_path, tiny_ckpt):
    """`vlbatch run` as a user would (joining the session's Ray): a plain folder of images as a glob input,
    given relative to the current directory, two questions and the caption: one row per (media,
    prompt); a rerun from another directory resumes the same run (nothing recomputed)."""
    from test_jobs_support import read_output, vlbatch, write_job

    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2, write_batch=2,
                    extra="task: {mode: questions, questions: ['What colour?', 'How many?'], caption: true, "
                          "prompt: Describe.}\n")
    sets = ["--set", "input.uri=wd/media", "--set", "input.format=glob"]  # the run id derived from the config
    first = vlbatch("run", str(cfg), "--no-lock", *sets, cwd=tmp_path, timeout=400)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    last = first.stdout.splitlines()[-1]
    assert "done: 6 ok, 0 error, 0 skipped" in last
    run_dir = last.split(" -> ", 1)[1].split("/ in ", 1)[0]
    rows = read_output(Path(run_dir))
    media = sorted(str(p) for p in (tmp_path / "wd" / "media").glob("*.png"))
    assert sorted((r["media_uri"], r["request_index"], r["prompt"]) for r in rows) == sorted(
        (m, k, p) for m in media for k, p in enumerate(["What colour?", "How many?", "Describe."]))
    assert all(r["status"] == "ok" and r["answer"] is not None for r in rows)

    other = [a.replace("input.uri=wd/media", f"input.uri={tmp_path / 'wd' / 'media'}") for a in sets]
    again = vlbatch("run", str(cfg), "--no-lock", *other, cwd=tmp_path / "wd", timeout=400)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    # every request committed: said before Ray starts, and none starts (pipeline/startup/nothing_to_do.py)
    assert again.stdout.splitlines()[-1] == f"[vlbatch] nothing to do: all 6 requests of {run_dir}/ are committed"
