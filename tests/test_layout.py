"""Issue 61: `pipeline/` laid out by where code runs, and no product file over 400 lines.

`pipeline/stages/` holds what runs in Ray actors and tasks (a module per CPU stage class: `decode.py`,
`preprocess.py`, `prepare.py`), `pipeline/startup/` the driver's start-up, `pipeline/backends/` the model
backends. The plan names its stage classes as "module:attr" strings, so a moved class is caught here (and by
an end-to-end run), not by an import. Real parts: a real manifest, the real plan and the real classes.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("operators", "pipeline", "jobs", "models", "scripts/devtools")


def test_no_product_file_is_over_400_lines():
    long = {str(f.relative_to(ROOT)): n for top in PRODUCT for f in sorted((ROOT / top).rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > 400}
    assert long == {}


@pytest.mark.parametrize("section, want", [
    ({}, {"decode+preprocess": "vlbatch.pipeline.stages.prepare:PrepareStage"}),
    ({"resources": {"fuse_cpu_stages": False}}, {"decode": "vlbatch.pipeline.stages.decode:DecodeStage",
                                                "preprocess": "vlbatch.pipeline.stages.preprocess:PreprocessStage"}),
])
def test_each_cpu_stage_class_the_plan_names_is_its_own_stages_module(tmp_path, section, want):
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.plan.spec import plan

    (tmp_path / "m.jsonl").write_text('{"media_uri": "a.png"}\n')
    cfg = validate_config({"model": {"path": str(tmp_path / "ckpt")}, "input": {"uri": str(tmp_path / "m.jsonl"),
                           "format": "jsonl"}, "output": {"uri": str(tmp_path / "out")}, **section})
    specs = {s.name: s.target for s in plan(cfg, None).stages}
    assert {k: specs[k] for k in want} == want
    for target in specs.values():  # every class the plan names (the model and write stages too) resolves
        module, _, attr = target.partition(":")
        assert module.startswith("vlbatch.pipeline.stages."), target
        assert isinstance(getattr(importlib.import_module(module), attr), type), target


def test_driver_start_up_and_backends_are_packages_of_their_own():
    from vlbatch.pipeline.config.model_backends import MODEL_BACKENDS

    for name in ("nothing_to_do", "placement", "node_loss"):
        assert (ROOT / "pipeline/startup" / f"{name}.py").is_file(), name
        assert not (ROOT / "pipeline/stages" / f"{name}.py").exists(), name
    for name in ("backends", "followers"):
        assert (ROOT / "pipeline/backends" / f"{name}.py").is_file(), name
        assert not (ROOT / "pipeline/stages" / f"{name}.py").exists(), name
    assert not (ROOT / "pipeline" / "stages" / "cpu.py").exists()  # split: decode, preprocess, prepare
    # the run's sink is opened by the driver and by each write actor from plan/sink.py, not from the actor's module
    assert "def open_sink" not in (ROOT / "pipeline/stages/write_stage.py").read_text()
    for entry in MODEL_BACKENDS.entries:  # the shipped backends' "module:attr" strings resolve in their package
        assert entry.target.startswith("vlbatch.pipeline.backends.backends:"), entry.target
        assert isinstance(entry.load(), type), entry.target
