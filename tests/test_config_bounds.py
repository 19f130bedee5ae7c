"""A job config's parsed values are bounded before validation walks them (`pipeline/config/bounds.py`):
700 bytes of nested YAML aliases held validate for minutes (10^8 values once expanded, walked by the JSON
Schema check); a recursive alias or 100,000 nested brackets ended in a RecursionError traceback. Each is
one line naming the file (or the ``--set``), and a config using aliases as meant still loads."""
from __future__ import annotations

import json

import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import load_config

JOB = "model: {path: /m}\ninput: {uri: /x.jsonl}\noutput: {uri: /o}\n"


def _bomb(levels: int) -> str:
    """`levels` anchors, each a list of 10 aliases of the one before: 10^levels values once expanded."""
    lines = ["anchors:", "  a0: &a0 [x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _refused(tmp_path, text: str, overrides=()) -> str:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(p, list(overrides))
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_an_alias_bomb_is_refused_before_validation(tmp_path):
    msg = _refused(tmp_path, JOB + _bomb(7))
    assert msg.startswith(f"job config {tmp_path / 'job.yaml'}: holds ") and \
        "values once its YAML aliases (*name) are expanded, over the limit of 1000000" in msg, msg


def test_a_recursive_alias_is_refused(tmp_path):
    text = JOB + "task: {mode: caption, response_format: {type: json_schema, schema: &s {type: object, " \
                 "properties: {x: *s}}}}\n"
    assert _refused(tmp_path, text).endswith(": holds a recursive YAML alias (a node inside itself)")


@pytest.mark.slow
def test_deep_nesting_is_refused_in_one_line(tmp_path):
    assert _refused(tmp_path, JOB + "x: " + "[" * 100_000 + "]" * 100_000 + "\n").endswith(
        ": nested too deeply (at most 64 levels)")
    assert _refused(tmp_path, JOB + "x: " + "[" * 70 + "]" * 70 + "\n").endswith(
        ": nested more than 64 levels deep")


def test_a_set_value_is_bounded_too(tmp_path):
    value = "[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10 if i else ["x"]) + "]" for i in range(8)) + "]"
    msg = _refused(tmp_path, JOB, [f"task.questions={value}"])
    assert msg.startswith("--set task.questions=") and "over the limit of 1000000" in msg, msg


def test_a_schema_file_nested_too_deeply_is_refused(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"type": "array", "items": ' * 70 + "{}" + "}" * 70)
    p = tmp_path / "job.yaml"
    p.write_text(JOB + "task: {mode: caption, response_format: {type: json_schema, schema_file: deep.json}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert str(err.value).splitlines()[1:] == [
        f"  task.response_format: schema_file: {deep} nested more than 64 levels deep"], err.value


def test_aliases_used_as_meant_still_load(tmp_path):
    p = tmp_path / "job.yaml"
    fmt = {"type": "json_schema", "schema": {"type": "object"}}
    p.write_text(JOB + f"task:\n  mode: questions\n  questions:\n    - {{name: a, prompt: 'A?', response_format: &f "
                       f"{json.dumps(fmt)}}}\n    - {{name: b, prompt: 'B?', response_format: *f}}\n")
    cfg = load_config(p)
    assert [q.response_format.spec() for q in cfg.task.questions] == [("json_schema", '{"type": "object"}')] * 2
