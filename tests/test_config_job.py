"""Job config: YAML + overrides, complete validation with field names, schema export."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import SCHEMA_PATH, job_schema, load_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
MIN = {"model": {"path": "m"}, "input": {"uri": "in.parquet"}, "output": {"uri": "out"}}


def _yaml(tmp_path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_demo_config_is_valid():
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    assert cfg.output.run_id == "demo" and cfg.model.dtype == "float32"


def test_overrides_parse_yaml_values_and_create_sections(tmp_path):
    p = _yaml(tmp_path, "model: {path: m}\ninput: {uri: x}\noutput: {uri: o}\n")
    cfg = load_config(p, ["sampling.temperature=0.7", "resources.model.num_gpus=1", "task.thinking=true",
                          "task.questions=[a, b]", "task.mode=questions", "output.run_id=r1"])
    assert cfg.sampling.temperature == 0.7 and cfg.resources.model.num_gpus == 1.0
    assert cfg.task.thinking is True and cfg.task.questions == ("a", "b") and cfg.output.run_id == "r1"


def test_errors_name_every_bad_field_and_allowed_values():
    bad = {**MIN, "model": {"path": "m", "dtype": "fp8"}, "input": {"uri": "x", "fromat": "csv"},
           "video": {"fps": 2, "num_frames": 8}, "resources": {"model": {"min_actors": 3, "max_actors": 1}},
           "sampling": {"temperature": -1}}
    with pytest.raises(ConfigError) as e:
        validate_config(bad)
    msg = str(e.value)
    assert "model.dtype" in msg and "'float32', 'bfloat16' or 'float16'" in msg
    assert "input.fromat" in msg and "allowed: columns, format, limit, uri" in msg
    assert "video:" in msg and "either fps or num_frames" in msg
    assert "resources.model" in msg and "min_actors" in msg
    assert "sampling.temperature" in msg


def test_missing_required_and_cross_field_rules():
    with pytest.raises(ConfigError, match=r"output: required field is missing"):
        validate_config({"model": {"path": "m"}, "input": {"uri": "x"}})
    with pytest.raises(ConfigError, match="task.mode=questions needs"):
        validate_config({**MIN, "task": {"mode": "questions"}})
    with pytest.raises(ConfigError, match=r"output.run_id"):
        validate_config({**MIN, "output": {"uri": "o", "run_id": "has space"}})


def test_override_errors_are_config_errors(tmp_path):
    p = _yaml(tmp_path, "model: {path: m}\ninput: {uri: x}\noutput: {uri: o}\n")
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config(p, ["sampling.temperature"])
    with pytest.raises(ConfigError, match="model.path is a value, not a section"):
        load_config(p, ["model.path.x=1"])
    with pytest.raises(ConfigError, match=r"sampling.max_tokens"):
        load_config(p, ["sampling.max_tokens=lots"])
    with pytest.raises(ConfigError, match="cannot read job config"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_yaml(tmp_path, "model: [unclosed\n"))


def test_run_id_depends_on_inputs_not_on_resources():
    a = validate_config(MIN)
    b = validate_config({**MIN, "resources": {"model": {"max_actors": 4}}, "output": {"uri": "elsewhere"}})
    c = validate_config({**MIN, "task": {"prompt": "Other prompt."}})
    assert a.resolved_run_id() == b.resolved_run_id() != c.resolved_run_id()
    assert validate_config({**MIN, "output": {"uri": "o", "run_id": "x1"}}).resolved_run_id() == "x1"


def test_config_is_frozen():
    cfg = validate_config(MIN)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        cfg.sampling.temperature = 1.0


def test_exported_schema_is_current():
    """configs/job.schema.json must equal what `python -m vlbatch.pipeline.config --schema` writes now."""
    on_disk = json.loads(SCHEMA_PATH.read_text())
    assert on_disk == json.loads(json.dumps(job_schema(), sort_keys=True)), \
        "regenerate with: python -m vlbatch.pipeline.config --schema"
    assert "max_error_fraction" in on_disk["properties"]


def test_demo_inputs_match_the_demo_config(tmp_path):
    """prepare_demo writes what configs/demo.yaml (with demo_overrides) points at."""
    import json as _json

    from vlbatch.pipeline.demo import demo_overrides, prepare_demo

    manifest = prepare_demo(tmp_path)
    cfg = load_config(ROOT / "configs" / "demo.yaml", demo_overrides(tmp_path))
    assert Path(cfg.input.uri) == manifest and (Path(cfg.model.path) / "config.json").exists()
    lines = [_json.loads(x) for x in manifest.read_text().splitlines()]
    assert {x["media_type"] for x in lines} == {"image", "video"}
    assert all(Path(x["media_uri"]).exists() for x in lines)
    from vlbatch.pipeline.demo import BUNDLED_MODEL, demo_truth

    assert Path(cfg.model.path) == BUNDLED_MODEL  # the demo captions with the bundled trained model
    truth = demo_truth(tmp_path)
    assert len(truth) >= 8 and set(truth) <= {x["media_uri"] for x in lines}
    assert len(lines) > len(truth)  # bad media are in the manifest too
