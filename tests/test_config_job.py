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
    assert cfg.task.thinking is True and cfg.task.question_prompts() == ["a", "b"] and cfg.output.run_id == "r1"


def test_errors_name_every_bad_field_and_allowed_values():
    bad = {**MIN, "model": {"path": "m", "dtype": "fp8"}, "input": {"uri": "x", "fromat": "csv"},
           "video": {"fps": 2, "num_frames": 8}, "resources": {"model": {"min_actors": 3, "max_actors": 1}},
           "sampling": {"temperature": -1}}
    with pytest.raises(ConfigError) as e:
        validate_config(bad)
    msg = str(e.value)
    assert "model.dtype" in msg and "'float32', 'bfloat16' or 'float16'" in msg
    assert "input.fromat" in msg and "allowed: columns, follow_symlinks, format, limit, uri" in msg
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


@pytest.mark.slow
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


def test_relative_paths_in_the_file_resolve_against_its_folder(tmp_path, monkeypatch):
    sub = tmp_path / "jobs"
    sub.mkdir()
    p = sub / "job.yaml"
    p.write_text("model: {path: ckpt}\ninput: {uri: ../media/*.png, format: glob}\noutput: {uri: s3://b/out}\n")
    monkeypatch.chdir(tmp_path.parent)  # any working directory
    cfg = load_config(p)
    assert cfg.model.path == str(sub / "ckpt") and cfg.input.uri == str(tmp_path / "media" / "*.png")
    assert cfg.output.uri == "s3://b/out"  # remote URIs untouched
    over = load_config(p, ["model.path=rel/ckpt", "output.uri=out"])  # --set: the cwd's, made absolute
    assert over.model.path == str(tmp_path.parent / "rel" / "ckpt") and over.output.uri == str(tmp_path.parent / "out")
    absolute = _yaml(tmp_path, f"model: {{path: {tmp_path}}}\ninput: {{uri: x}}\noutput: {{uri: o}}\n")
    assert load_config(absolute).model.path == str(tmp_path) and load_config(absolute).output.uri == str(tmp_path / "o")


def test_demo_config_finds_the_bundled_model_from_any_directory(tmp_path, monkeypatch):
    from vlbatch.pipeline.demo import BUNDLED_MODEL
    from vlbatch.pipeline.plan.checks import check_paths

    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    assert Path(cfg.model.path) == BUNDLED_MODEL
    assert Path(cfg.input.uri) == ROOT / "out" / "demo" / "media" / "manifest.jsonl"
    with pytest.raises(ConfigError) as e:  # only the demo's media are missing until prepare_demo
        check_paths(load_config(ROOT / "configs" / "demo.yaml", [f"input.uri={tmp_path / 'm.jsonl'}"]))
    assert "model.path" not in str(e.value) and "input.uri" in str(e.value)


def test_check_paths_names_each_missing_local_path(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.plan.checks import check_paths

    ckpt = tiny_ckpt("dense")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"media_uri": "a.png"}\n')
    ok = {"model": {"path": str(ckpt)}, "input": {"uri": str(manifest), "format": "jsonl"}, "output": {"uri": "o"}}
    check_paths(validate_config(ok))
    check_paths(validate_config({**ok, "input": {"uri": str(tmp_path), "format": "jsonl"}}))  # a folder of parts
    check_paths(validate_config({**ok, "model": {"path": "s3://bucket/ckpt"}, "input": {"uri": "s3://b/m.parquet"}}))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    empty = partial / "empty"
    empty.mkdir()
    cases = {
        "model.path: " + str(tmp_path / "absent") + " does not exist": {"model": {"path": str(tmp_path / "absent")}},
        "is not a directory": {"model": {"path": str(manifest)}},
        "has no *.safetensors, tokenizer.json": {"model": {"path": str(partial)}},
        f"input.uri: {tmp_path / 'gone.jsonl'} does not exist": {"input": {"uri": str(tmp_path / "gone.jsonl")}},
        "input.uri: the glob": {"input": {"uri": str(tmp_path / "*.mp4"), "format": "glob"}},
        "is an empty folder": {"input": {"uri": str(empty), "format": "parquet"}},
    }
    for want, patch in cases.items():
        with pytest.raises(ConfigError) as e:
            check_paths(validate_config({**ok, **patch}))
        assert want in str(e.value), (want, str(e.value))
    with pytest.raises(ConfigError) as e:  # every bad field at once
        check_paths(validate_config({**ok, "model": {"path": str(partial)}, "input": {"uri": str(tmp_path / "g*")}}))
    assert "model.path:" in str(e.value) and "input.uri:" in str(e.value)
