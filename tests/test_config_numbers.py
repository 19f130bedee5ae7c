"""Numbers in the job config (issue 60, item 3): every float is finite and within its stated range, and
a bool or a string is never a number (`pipeline/config/types.py`). `video.clips.window_s: .inf` passed
validate and made every video a MediaError (OverflowError); `1e300`, `true` and `"10"` were coerced."""
from __future__ import annotations

import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import JobConfig, load_config

# (dotted field, YAML value) pairs, each refused; YAML as a user writes it (PyYAML reads 1e300 as a string)
FLOATS = ["video.clips.window_s", "sampling.temperature", "resources.model.num_gpus", "output.commit_interval_s",
          "storage.http_min_bytes_per_s", "video.fps", "max_error_fraction"]
NOT_FINITE_OR_HUGE = [".inf", "-.inf", ".nan", "1e300", "1.0e+300", "true", '"10"']
INTS = ["sampling.max_tokens", "resources.preprocess.max_actors", "storage.retries", "video.max_frames"]
NOT_INTS = ["true", '"10"', "10.0", ".inf"]


def _yaml(tmp_path, dotted: str, value: str):
    """A job YAML with `dotted: value` (the value's text as written) in its nested sections."""
    import yaml

    data = {"model": {"path": "/m"}, "input": {"uri": "/x.jsonl"}, "output": {"uri": "/o"}}
    *sections, key = dotted.split(".")
    node = data
    for s in sections:
        node = node.setdefault(s, {})
    node[key] = "VALUE_HERE"
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data).replace("VALUE_HERE", value))
    return p


def _refused_line(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1, err.value
    return lines[0].strip()


@pytest.mark.parametrize("value", NOT_FINITE_OR_HUGE)
@pytest.mark.parametrize("field", FLOATS)
def test_a_float_field_refuses_what_is_not_a_finite_number_in_range(tmp_path, field, value):
    line = _refused_line(_yaml(tmp_path, field, value))
    assert line.startswith(f"{field}: "), line


@pytest.mark.parametrize("value", NOT_INTS)
@pytest.mark.parametrize("field", INTS)
def test_an_int_field_refuses_bools_strings_and_floats(tmp_path, field, value):
    line = _refused_line(_yaml(tmp_path, field, value))
    assert line.startswith(f"{field}: "), line


def test_the_issue_values_are_refused_with_their_reason(tmp_path):
    want = {".inf": "Input should be a finite number", "1e300": "Input should be a valid number",
            "1.0e+300": "Input should be less than or equal to 3600", "true": "Input should be a valid number",
            '"10"': "Input should be a valid number"}
    for value, words in want.items():
        line = _refused_line(_yaml(tmp_path, "video.clips.window_s", value))
        assert line.startswith(f"video.clips.window_s: {words}"), line


def test_a_set_override_is_refused_naming_the_field_and_the_override(tmp_path):
    line = _refused_line(_yaml(tmp_path, "video.fps", "2"), ["video.clips.window_s=.inf"])
    assert line.startswith("video.clips.window_s: Input should be a finite number") and \
        line.endswith("(from --set video.clips.window_s=.inf)"), line


def test_an_integer_is_a_float_fields_whole_value(tmp_path):
    cfg = load_config(_yaml(tmp_path, "video.clips.window_s", "6"), ["ray.node_loss_timeout_s=600",
                                                                     "resources.model.num_gpus=1"])
    assert cfg.video.clips.window_s == 6.0 and isinstance(cfg.video.clips.window_s, float)
    assert cfg.ray.node_loss_timeout_s == 600.0 and cfg.resources.model.num_gpus == 1.0


def _number_fields(model, prefix=""):
    """(dotted name, number type, its metadata) of every int / float field of the config, sections walked
    (`Float | None`: the metadata of its `Float`, with the field's own bounds)."""
    from typing import Annotated, get_args, get_origin

    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        parts = get_args(info.annotation) if get_origin(info.annotation) is not Annotated else ()
        for part in parts or (info.annotation,):
            if isinstance(part, type) and issubclass(part, BaseModel):
                yield from _number_fields(part, f"{prefix}{name}.")
                continue
            base, meta = (get_args(part)[0], get_args(part)[1:]) if get_origin(part) is Annotated else (part, ())
            if base in (int, float):
                yield f"{prefix}{name}", base, (*meta, *info.metadata)


def test_every_number_field_is_strict_and_every_float_finite_and_bounded():
    """No int / float field is left lax: each is the config's `Int` / `Float` (strict; a float finite) and a
    float has an upper bound, so a new field cannot slip back into coercing `true` or taking `.inf`."""
    from annotated_types import Le, Lt
    from pydantic import AllowInfNan, Strict

    fields = {name: (base, {type(m) for m in meta}) for name, base, meta in _number_fields(JobConfig)}
    assert {"video.clips.window_s", "video.fps", "sampling.max_tokens", "output.part_mb"} <= set(fields)
    for name, (base, kinds) in fields.items():
        assert Strict in kinds, f"{name}: not strict"
        if base is float:
            assert AllowInfNan in kinds and kinds & {Le, Lt}, f"{name}: not finite, or no upper bound"
