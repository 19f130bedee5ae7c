"""Packaging: the built wheel installs one `vlbatch` import namespace, and the product never imports devtools.

The wheel is built from a copy of the repository's packaged files (so the checkout gets no
build/ or egg-info), installed with `--no-deps` into a fresh virtualenv without the system's
site-packages, and imported from a folder outside the repository: only modules that need no
third-party package are imported there (the dependencies are not in that venv on purpose).
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ("operators", "pipeline", "jobs", "models", "scripts", "setup.py", "pyproject.toml", "README.md")
# Import names the wheel must not put into site-packages (generic names that collide with other installs).
FORBIDDEN_TOP_LEVEL = ("operators", "pipeline", "jobs", "models", "devtools", "scripts", "benchmarks", "tests")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in PACKAGED:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        else:
            shutil.copy2(p, src / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True, timeout=300)
    (whl,) = out.glob("vlbatch-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_holds_only_the_vlbatch_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"vlbatch"}, tops
    # every package folder of the repository is in the wheel, the bundled model and tokenizer assets too
    for pkg in ("operators/engine", "operators/media/decoders", "pipeline", "jobs", "devtools/checkpoints"):
        assert f"vlbatch/{pkg}/__init__.py" in names, pkg
    assert "vlbatch/models/shapes-tiny/config.json" in names
    assert "vlbatch/devtools/checkpoints/assets/tokenizer.json" in names
    assert not any(n.startswith("vlbatch/__init__") for n in names), "vlbatch is an implicit namespace package"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vlbatch = vlbatch.jobs.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.slow
def test_fresh_venv_imports_vlbatch_and_not_the_folder_names(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # install with this interpreter's pip into the venv's site-packages (the venv has no pip of its own)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", site,
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    probe = (
        "import importlib, sys\n"
        "import vlbatch, vlbatch.operators.errors, vlbatch.pipeline, vlbatch.jobs, vlbatch.models, vlbatch.devtools\n"
        "assert vlbatch.models.SHAPES_TINY.joinpath('config.json').is_file()\n"
        f"for name in {FORBIDDEN_TOP_LEVEL!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    sys.exit(f'{name} is importable')\n"
        "print(vlbatch.operators.errors.__file__)\n"
    )
    run = subprocess.run([py, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.strip().startswith(site)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


# The demo and the make-tiny-checkpoint command are the only users of devtools outside tests and benchmarks.
DEVTOOLS_USERS = {"pipeline/demo.py", "jobs/demo.py", "jobs/cli.py"}


def test_product_path_never_imports_devtools():
    offenders = []
    for folder in ("operators", "pipeline", "jobs"):
        for f in (ROOT / folder).rglob("*.py"):
            rel = f.relative_to(ROOT).as_posix()
            if rel in DEVTOOLS_USERS:
                continue
            if any(m.startswith("vlbatch.devtools") for m in _imports(f)):
                offenders.append(rel)
    assert not offenders, offenders


@pytest.mark.slow
def test_running_a_job_loads_no_devtools_module():
    """The modules a `vlbatch run` loads (CLI, runner, stages, engine backend) pull in no devtools module."""
    probe = ("import sys; import vlbatch.jobs.cli, vlbatch.jobs.local, vlbatch.pipeline.graph, "
             "vlbatch.pipeline.stages.prepare, vlbatch.pipeline.stages.model_stage, vlbatch.operators.engine, vlbatch.operators.media; "
             "bad = [m for m in sys.modules if m.startswith('vlbatch.devtools')]; print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
