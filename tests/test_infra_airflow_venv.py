"""infra/airflow/setup-venv.sh's path logic (no Airflow install: LINK_ONLY=1): the Airflow
venv sees the packages of the interpreter that made it ($PY), also when $PY is a venv's
python (whose --system-site-packages "system" is only its base interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_jobs_support import REPO

SETUP = REPO / "infra" / "airflow" / "setup-venv.sh"


def _setup(py: str, venv: Path) -> None:
    env = dict(os.environ, PY=py, LINK_ONLY="1")
    r = subprocess.run(["bash", str(SETUP), str(venv)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


def _run(venv: Path, code: str) -> str:
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


@pytest.mark.slow
def test_airflow_venv_imports_this_interpreters_vlbatch_and_ray(tmp_path):
    venv = tmp_path / "af"
    _setup(sys.executable, venv)
    out = _run(venv, "import ray, vlbatch.jobs.spec as s; print(s.__file__)")
    # this checkout's vlbatch, not another install the base interpreter may hold
    assert Path(out) == REPO / "jobs" / "spec.py"


@pytest.mark.slow
def test_a_venv_callers_own_site_packages_and_pth_files_reach_the_airflow_venv(tmp_path):
    """$PY is a fresh venv (no system site packages) holding a package and an editable-style
    .pth (a path line) in its own site-packages: both must be importable from the Airflow venv."""
    caller = tmp_path / "caller"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(caller)], check=True, timeout=120)
    cpy = str(caller / "bin" / "python")
    purelib = Path(subprocess.run([cpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "vlb_probe_pkg").mkdir()
    (purelib / "vlb_probe_pkg" / "__init__.py").write_text("WHERE = 'caller site-packages'\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "vlb_probe_src.py").write_text("WHERE = 'editable src'\n")
    (purelib / "__editable__.vlb_probe.pth").write_text(f"{src}\n")
    venv = tmp_path / "af"
    _setup(cpy, venv)
    out = _run(venv, "import vlb_probe_pkg, vlb_probe_src; print(vlb_probe_pkg.WHERE, '|', vlb_probe_src.WHERE)")
    assert out == "caller site-packages | editable src"
    # the Airflow venv's own packages stay first on its sys.path; the link is refreshed, not duplicated
    _setup(cpy, venv)
    paths = _run(venv, "import sys; print('\\n'.join(sys.path))").splitlines()
    own = [i for i, p in enumerate(paths) if p.startswith(str(venv))]
    assert own and own[0] < paths.index(str(purelib)) and paths.count(str(purelib)) == 1
