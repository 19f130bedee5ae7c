"""Structured answers in the job config (issue 52): named questions with a response format,
`schema_file` relative to the config, and every refusal one line naming the field."""
from __future__ import annotations

import json

import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import load_config, validate_config

MIN = {"model": {"path": "m"}, "input": {"uri": "in.parquet"}, "output": {"uri": "out"}}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["tags"]}


def _task(**task):
    return validate_config({**MIN, "task": {"mode": "questions", **task}})


def _refused(**task) -> str:
    with pytest.raises(ConfigError) as e:
        _task(**task)
    return str(e.value)


def test_questions_are_strings_or_named_formats_and_names_default_to_q_index():
    cfg = _task(caption=True, questions=[
        "How many?", {"name": "has_text", "prompt": "Text?", "response_format": {"type": "choice", "choices": ["y", "n"]}},
        {"prompt": "Year?", "response_format": {"type": "regex", "pattern": "[12][0-9]{3}"}}],
        response_format={"type": "json_schema", "schema": TAGS})
    assert cfg.task.question_prompts() == ["How many?", "Text?", "Year?"]
    formats = cfg.task.prompt_formats()
    assert formats == {"has_text": ("choice", '["y", "n"]'), "q2": ("regex", "[12][0-9]{3}"),
                       "caption": ("json_schema", json.dumps(TAGS, sort_keys=True))}


def test_plain_questions_keep_their_run_id():
    """A config of plain string questions has the run id it had before named questions existed."""
    plain = _task(questions=["a", "b"])
    dumped = plain.model_dump(mode="json", include={"task"})["task"]
    assert dumped["questions"] == ["a", "b"] and dumped["response_format"] is None
    assert plain.resolved_run_id() == "run-" + _old_run_id(plain)


def _old_run_id(cfg) -> str:
    import hashlib

    basis = cfg.model_dump(mode="json", include={"model", "input", "task", "sampling", "image", "video"})
    for how in ("engine", "tensor_parallel_size", "expert_parallel"):
        basis["model"].pop(how, None)
    basis["input"].pop("follow_symlinks", None)
    basis["task"].pop("response_format")  # the field did not exist
    for how in ("decoder", "decode_device"):
        basis["video"].pop(how, None)
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:12]


def test_schema_file_is_read_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "tags.json").write_text(json.dumps(TAGS))
    p = tmp_path / "job.yaml"
    p.write_text("model: {path: m}\ninput: {uri: in.parquet}\noutput: {uri: out}\ntask:\n  mode: questions\n"
                 "  questions:\n    - {name: tags, prompt: Tag it., response_format: "
                 "{type: json_schema, schema_file: schemas/tags.json}}\n")
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_config(p)
    assert cfg.task.prompt_formats() == {"tags": ("json_schema", json.dumps(TAGS, sort_keys=True))}


@pytest.mark.parametrize(("fmt", "field", "words"), [
    ({"type": "json_schema", "schema": {"type": "strange"}}, "task.questions.0.response_format", "JSON Schema"),
    ({"type": "json_schema", "schema": {"properties": {"a": {"minimum": "x"}}}}, "task.questions.0.response_format",
     "properties/a/minimum"),
    ({"type": "regex", "pattern": "[12"}, "task.questions.0.response_format", "pattern: not a regular expression"),
    ({"type": "choice", "choices": []}, "task.questions.0.response_format", "choices: the list is empty"),
    ({"type": "choice"}, "task.questions.0.response_format", "needs choices"),
    ({"type": "regex", "pattern": "a", "choices": ["a"]}, "task.questions.0.response_format", "does not use choices"),
    ({"type": "json_schema", "schema_file": "/nonexistent/s.json"}, "task.questions.0.response_format",
     "schema_file: cannot read"),
])
def test_bad_formats_are_refused_in_one_line_naming_the_field(fmt, field, words):
    msg = _refused(questions=[{"name": "x", "prompt": "p?", "response_format": fmt}])
    lines = msg.splitlines()[1:]
    assert len(lines) == 1 and lines[0].strip().startswith(field) and words in lines[0], msg


def test_two_questions_with_one_name_are_refused():
    msg = _refused(questions=[{"name": "a", "prompt": "p?"}, "q?", {"name": "a", "prompt": "r?"}])
    assert "task.questions.2.name: 'a' is also question 0's name" in msg, msg
    msg = _refused(questions=["p?", {"name": "q0", "prompt": "r?"}])  # the default name counts
    assert "task.questions.1.name: 'q0'" in msg, msg
    assert "caption's name" in _refused(questions=[{"name": "caption", "prompt": "p?"}])


def test_caption_format_without_a_caption_is_an_ignored_field():
    msg = _refused(questions=["a?"], response_format={"type": "regex", "pattern": "a"})
    assert "task.response_format: not used by task.mode=questions without a caption" in msg, msg


@pytest.mark.slow
def test_formats_the_grammar_engine_refuses_are_named_by_validate(tmp_path, tiny_ckpt):
    """Valid for Python's `re` / the meta-schema, refused by xgrammar: a backreference, a dangling $ref.
    `vlbatch validate` (the real CLI) says so in one line naming the field; a plain config imports no xgrammar."""
    from test_preflight import _job, _validate

    from vlbatch.pipeline.plan.checkpoint import response_format_problems

    cfg = _task(caption=True, questions=[{"prompt": "p?", "response_format": {"type": "regex", "pattern": r"(a)\1"}}],
                response_format={"type": "json_schema", "schema": {"$ref": "#/defs/none"}})
    problems = response_format_problems(cfg)
    assert len(problems) == 2 and problems[0].startswith("task.questions.0.response_format (question 'q0'): ") \
        and "Backreference" in problems[0] \
        and problems[1].startswith("task.response_format (question 'caption'): "), problems
    assert response_format_problems(_task(questions=["a?"])) == []
    job = _job(tmp_path, tiny_ckpt("dense"), "task:\n  mode: questions\n  questions:\n    - {prompt: 'p?', "
                                             "response_format: {type: regex, pattern: '(a)\\1'}}\n")
    r = _validate(job)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if "response_format" in ln]
    assert len(lines) == 1 and "task.questions.0.response_format" in lines[0] and "Backreference" in lines[0], r.stderr


@pytest.mark.slow
def test_validate_refuses_a_format_over_the_grammar_budget_naming_the_question(tmp_path, tiny_ckpt):
    """A schema of a 60,000-value enum (valid, about ten seconds to compile even at the tiny checkpoint's
    vocabulary; minutes at a real one's): `vlbatch validate` compiles each distinct format once against the
    checkpoint's vocabulary in a child process killed at `model.engine.grammar.compile_s`, and refuses it in
    one line per question naming the field, the question and the budget; over `max_bytes` (the default 128 KiB)
    it is refused before compiling. The quick format beside it passes."""
    from test_preflight import _job, _validate

    (tmp_path / "big.json").write_text(json.dumps({"enum": [f"v{i:06d}x" for i in range(60_000)]}))
    job = _job(tmp_path, tiny_ckpt("dense"), "task:\n  mode: questions\n  questions:\n"
               "    - {name: tags, prompt: 'p?', response_format: {type: json_schema, schema_file: big.json}}\n"
               "    - {name: year, prompt: 'y?', response_format: {type: regex, pattern: '[12][0-9]{3}'}}\n"
               "    - {name: labels, prompt: 'l?', response_format: {type: json_schema, schema_file: big.json}}\n")
    r = _validate(job, "--set", "model.engine.grammar.compile_s=1", "--set", "model.engine.grammar.max_bytes=1000000")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln.strip() for ln in r.stderr.splitlines() if "response_format" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["task.questions.0.response_format (question 'tags')",
                                                  "task.questions.2.response_format (question 'labels')"], r.stderr
    assert all("did not compile within the grammar budget of 1 s (model.engine.grammar.compile_s)" in ln
               for ln in lines), r.stderr
    r = _validate(job)  # the default max_bytes: refused by its size, nothing compiled
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln.strip() for ln in r.stderr.splitlines() if "response_format" in ln]
    assert len(lines) == 2 and all("over the grammar budget of 131072 bytes (model.engine.grammar.max_bytes)" in ln
                                   for ln in lines), r.stderr
