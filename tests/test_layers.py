"""The layer contracts in pyproject.toml ([tool.importlinter]) hold, and they can fail.

`lint-imports` (import-linter, over grimp's import graph, lazy imports inside functions included)
checks that each layer imports only those below it, that the engine's and the pipeline's parts go one
way, that no sibling packages or modules import each other in a cycle, and that `vlbatch.devtools`
stays out of the product path. The second test runs the same contracts over a copy of the tree with
upward imports and one cycle added, so a contract that checked nothing would fail it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.tree_site import roots

REPO = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def _lint(config: Path, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-c", LINT, str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_layer_contracts_are_kept():
    done = _lint(REPO / "pyproject.toml", REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 5 kept, 0 broken." in done.stdout


def _copy(tmp: Path, name: str) -> Path:
    """The product's Python files under the import name `name` instead of `vlbatch` (a package
    of its own, so the installed vlbatch cannot shadow the copy) -> the copied contracts file."""
    for sub, folder in roots(REPO / "setup.py").items():
        shutil.copytree(REPO / folder, tmp / name / sub,
                        ignore=lambda d, names: [n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()
                                                 or n == "__pycache__"])
    for f in (tmp / name).rglob("*.py"):
        f.write_text(f.read_text().replace("vlbatch.", f"{name}."))
    config = tmp / "contracts.toml"
    config.write_text((REPO / "pyproject.toml").read_text().replace("vlbatch.", f"{name}."))
    return config


def test_an_upward_import_breaks_the_contracts(tmp_path):
    config = _copy(tmp_path, "vlbcopy")
    kept = _lint(config, tmp_path, pythonpath=str(tmp_path))
    assert kept.returncode == 0, kept.stdout + kept.stderr  # the copy itself is clean
    (tmp_path / "vlbcopy/operators/kernels/_upward.py").write_text("from vlbcopy.pipeline import config\n")
    (tmp_path / "vlbcopy/operators/engine/caches/_upward.py").write_text(
        "def f():\n    from vlbcopy.operators.engine.runner import model_runner\n")
    (tmp_path / "vlbcopy/pipeline/plan/_upward.py").write_text("from vlbcopy.pipeline.stages import rows\n")
    with (tmp_path / "vlbcopy/pipeline/plan/cluster.py").open("a") as f:  # spec imports cluster: a cycle
        f.write("\n\ndef _cycle():\n    from vlbcopy.pipeline.plan import spec\n")
    broken = _lint(config, tmp_path, pythonpath=str(tmp_path))
    assert broken.returncode == 1
    said = " ".join(broken.stdout.split())  # the report wraps long lines
    assert "Contracts: 1 kept, 4 broken." in said, broken.stdout
    assert "vlbcopy.pipeline.plan._upward -> vlbcopy.pipeline.stages.rows" in said
    assert "allowed in vlbcopy.pipeline.plan" in said and "- .spec -> .cluster (1 import)" in said
    assert "vlbcopy.operators.kernels._upward -> vlbcopy.pipeline.config" in said
    assert "vlbcopy.operators.engine.caches._upward -> vlbcopy.operators.engine.runner.model_runner" in said
