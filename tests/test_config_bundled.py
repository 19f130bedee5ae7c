"""`model.path: bundled:<name>` names a checkpoint shipped with vlbatch, the same from any directory
(issue 50: a user's own job pointed at the demo's model without knowing where pip put it)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vlbatch.models import SHAPES_TINY
from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import load_config

JOB = """model: {{path: "{path}", device: cpu, dtype: float32}}
input: {{uri: media/*.png, format: glob}}
output: {{uri: out}}
"""


def _job(tmp_path, path: str):
    cfg = tmp_path / "sub" / "job.yaml"
    cfg.parent.mkdir()
    cfg.write_text(JOB.format(path=path))
    return cfg


def test_bundled_names_the_shipped_checkpoint(tmp_path):
    assert load_config(_job(tmp_path, "bundled:shapes-tiny")).model.path == str(SHAPES_TINY)


@pytest.mark.parametrize("name", ["nope", "../shapes-tiny", "shapes-tiny/../..", "", "/etc"])
def test_an_unknown_bundled_name_is_refused_naming_the_field(tmp_path, name):
    with pytest.raises(ConfigError) as e:
        load_config(_job(tmp_path, f"bundled:{name}"))
    assert str(e.value).startswith("model.path: no bundled model") and "shapes-tiny" in str(e.value)


@pytest.mark.slow
def test_validate_accepts_it_from_another_directory(tmp_path):
    cfg = _job(tmp_path, "bundled:shapes-tiny")
    (cfg.parent / "media").mkdir()
    (cfg.parent / "media" / "a.png").write_bytes(b"")  # validate reads no media
    r = subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "validate", str(cfg), "--json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["config"]["model"]["path"] == str(SHAPES_TINY)
