"""Config errors a user meets on the first day (issue 50): a YAML syntax error names the config file,
line and column in one line (never PyYAML's `"<unicode string>", line 1, column 8`), and a bad
``--set`` names the override it came from; `vlbatch validate` prints that one line and exits 2."""
from __future__ import annotations

import pytest
from test_jobs_support import vlbatch

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import load_config

# (file text, the line and column PyYAML reports the problem at, a word of its problem)
BAD_YAML = [
    ("model:\n  path: [a\ninput: {uri: x}\n", "line 3, column 6", "expected ',' or ']'"),
    ("model: {path: \"a\n", "line 2, column 1", "end of stream"),
    ("model:\n  path: x\n   bad: 1\n", "line 3, column 7", "mapping values are not allowed"),
    ("model:\n\tpath: x\n", "line 2, column 1", "found character '\\t'"),
]


@pytest.mark.parametrize("text,where,problem", BAD_YAML)
def test_yaml_syntax_error_names_the_file_line_and_column_in_one_line(tmp_path, text, where, problem):
    path = tmp_path / "my job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "\n" not in msg and "<unicode string>" not in msg, msg
    assert msg.startswith(f"job config {path}, {where}: not valid YAML: "), msg
    assert problem in msg, msg


def test_config_file_that_is_not_text_is_one_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"model: {path: \xff\xfe}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"job config {path}: not UTF-8 text (byte 14)"), err.value


@pytest.mark.parametrize("override,want", [
    ("model.path=[a", "--set model.path=[a: the value is not valid YAML: column 3: "),
    ("sampling.max_tokens={a: [", "--set sampling.max_tokens={a: [: the value is not valid YAML: column "),
    ("model.path", "--set model.path: expected KEY.PATH=VALUE"),
    ("model..path=x", "--set model..path=x: empty field name in 'model..path'"),
    ("model.path.x=1", "--set model.path.x=1: model.path is a value, not a section"),
])
def test_bad_override_names_the_override_in_one_line(tmp_path, override, want):
    path = tmp_path / "job.yaml"
    path.write_text("model: {path: /m}\ninput: {uri: /x.jsonl}\noutput: {uri: /o}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [override])
    msg = str(err.value)
    assert "\n" not in msg and "<unicode string>" not in msg, msg
    assert msg.startswith(want), msg


@pytest.mark.slow
def test_validate_prints_one_line_naming_the_file_and_the_override(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: [a\ninput: {uri: x}\n")
    r = vlbatch("validate", str(bad), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"vlbatch: job config {bad}, line 3, column 6: not valid YAML: expected ',' "
                                     "or ']', but got ':' (while parsing a flow sequence at line 2, column 9)"]
    good = tmp_path / "good.yaml"
    good.write_text("model: {path: /m}\ninput: {uri: /x.jsonl}\noutput: {uri: /o}\n")
    r = vlbatch("validate", str(good), "--set", "model.path=[a", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("vlbatch: --set model.path=[a: "), r.stderr


def test_invalid_field_from_an_override_names_the_override(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: {path: /m}\ninput: {uri: /x.jsonl}\noutput: {uri: /o}\nsampling: {top_k: -5}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["sampling.max_tokens=abc", "sampling.bogus=1", "model.path=/m2"])
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 3, lines
    by_field = {line.split(":", 1)[0].strip(): line for line in lines}
    assert by_field["sampling.max_tokens"].endswith("(from --set sampling.max_tokens=abc)")
    assert by_field["sampling.bogus"].endswith("(from --set sampling.bogus=1)")
    assert "--set" not in by_field["sampling.top_k"]  # the file's own value
