"""Structured answers as rows (issue 52): prompt names from expansion, `parsed` and `prompt_name` columns,
`TruncatedError` rows (permanent: kept on resume), and one whole `vlbatch run` on a random tiny checkpoint
where every ok row of a constrained prompt parses and validates (the `jsonschema` library)."""
from __future__ import annotations

import json
import re

import jsonschema
import pyarrow as pa
import pytest

from vlbatch.operators.engine.request import Result, Timings
from vlbatch.operators.sink.base import is_retried
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA
from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.stages.model_stage import _columns
from vlbatch.pipeline.stages.requests import expand_rows
from vlbatch.pipeline.stages.rows import Generated, to_table
from vlbatch.pipeline.stages.write_stage import output_rows, output_tables

SCHEMA = {"type": "object", "properties": {"shape": {"enum": ["circle", "square"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                    "maxItems": 2}},
          "required": ["shape", "count", "tags"], "additionalProperties": False}
QUESTIONS = [
    "Describe it.",
    {"name": "obj", "prompt": "What is it?", "response_format": {"type": "json_schema", "schema": SCHEMA}},
    {"name": "text", "prompt": "Text?", "response_format": {"type": "choice", "choices": ["yes", "no"]}},
    {"prompt": "Year?", "response_format": {"type": "regex", "pattern": "[12][0-9]{3}"}},
]
MIN = {"model": {"path": "m"}, "input": {"uri": "in.jsonl"}, "output": {"uri": "out"}}


def _task():
    return validate_config({**MIN, "task": {"mode": "questions", "caption": True, "questions": QUESTIONS,
                                            "response_format": {"type": "regex", "pattern": "[a-z]{1,8}"}}}).task


def test_expansion_names_task_questions_and_the_caption_not_a_manifests_questions():
    task = _task()
    (row,) = expand_rows("a.png", "image", None, task)
    assert row.prompt_names == ("q0", "obj", "text", "q3", "caption")
    (own,) = expand_rows("a.png", "image", ["Is it red?", "Why?"], task)
    assert own.prompt_names == (None, None, "caption")  # the manifest's questions: no name, no format


def _result(text, *, parsed=None, truncated=False, reason="stop"):
    t = Timings(0.0, 0.0, 0.0)
    return Result(id="r", token_ids=(1, 2), text=text, thinking=None, finish_reason=reason, prompt_tokens=3,
                  visual_tokens=0, generated_tokens=2, cached_tokens=0, timings=t, parsed=parsed, truncated=truncated)


def test_truncated_answers_are_permanent_error_rows_without_a_parsed_value():
    cut = _columns(_result('{"shape": "cir', truncated=True, reason="length"))
    assert cut[6] == "TruncatedError" and "max_tokens" in cut[7] and cut[8] is None
    assert not is_retried("error", "TruncatedError")  # kept on resume: the same config truncates again
    ok = _columns(_result('"yes"', parsed='"yes"'))
    assert ok[6] is None and ok[8] == '"yes"'


def test_output_rows_carry_prompt_name_and_parsed_as_json():
    cols = [_columns(_result("yes", parsed='"yes"')), _columns(_result("{", truncated=True, reason="length"))]
    names = ("answers", "thinking", "finish_reasons", "prompt_tokens", "generated_tokens", "cached_tokens",
             "req_error_types", "req_error_messages", "parsed")
    g = Generated(media_uri="a.png", media_type="image", ids=("i0", "i1"), request_indices=(2, 4),
                  prompts=("Text?", "Describe."), prompt_names=("text", "caption"),
                  statuses=tuple("ok" if c[6] is None else "error" for c in cols),
                  **{n: tuple(c[k] for c in cols) for k, n in enumerate(names)})
    table, _ = output_tables(to_table([g], Generated), "m", "run")
    assert table.schema.equals(OUTPUT_SCHEMA) and table.schema.field("parsed").type == OUTPUT_SCHEMA.field("parsed").type
    rows = table.to_pylist()
    assert [r["prompt_name"] for r in rows] == ["text", "caption"]
    assert rows[0]["parsed"] == '"yes"' and rows[1]["parsed"] is None and rows[1]["error_type"] == "TruncatedError"
    naive = output_rows(g, "m", "run")  # the row-by-row twin agrees
    assert [(r.prompt_name, r.parsed) for r in naive] == [(r["prompt_name"], r["parsed"]) for r in rows]
    if hasattr(pa, "json_"):
        assert OUTPUT_SCHEMA.field("parsed").type == pa.json_()


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_writes_valid_structured_answers(tmp_path, tiny_ckpt):
    """End to end (the only whole run of issue 52's tests): every ok row of a constrained prompt parses and
    validates; free-text rows have no parsed value; rows cut by max_tokens are TruncatedError."""
    from test_jobs_support import read_output, vlbatch, write_job

    work = tmp_path / "job"
    cfg = write_job(work, tiny_ckpt("dense"), n_images=3, max_tokens=40)
    task = {"mode": "questions", "caption": True, "questions": QUESTIONS,
            "response_format": {"type": "regex", "pattern": "[a-z]{1,8}"}}
    cfg.write_text(cfg.read_text().replace("task: {prompt: Describe.}", "task: " + json.dumps(task)))
    r = vlbatch("run", str(cfg), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run_dir,) = [p for p in (tmp_path / "output").iterdir() if p.is_dir()]
    rows = read_output(run_dir)
    assert len(rows) == 3 * 5
    check = {"obj": lambda v: jsonschema.validate(v, SCHEMA), "text": lambda v: v in ("yes", "no"),
             "q3": lambda v: re.fullmatch("[12][0-9]{3}", v), "caption": lambda v: re.fullmatch("[a-z]{1,8}", v)}
    ok = 0
    for row in rows:
        name = row["prompt_name"]
        if name == "q0":
            assert row["status"] == "ok" and row["parsed"] is None
        elif row["status"] == "ok":
            value = json.loads(row["parsed"])
            assert check[name](value) is not False, row
            ok += 1
        else:
            assert row["error_type"] == "TruncatedError" and row["parsed"] is None, row
    assert ok >= 3 * 3  # choice, regex and caption answers always fit in 40 tokens
