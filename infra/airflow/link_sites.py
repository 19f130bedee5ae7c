"""Make the calling interpreter's packages importable in the Airflow virtualenv.

Usage: ``CALLER_PYTHON infra/airflow/link_sites.py VENV_DIR`` (run by infra/airflow/setup-venv.sh).

``--system-site-packages`` alone is not enough: when the caller is itself a virtualenv's
python, "system" means its base interpreter, so the Airflow venv would see neither the
caller's vlbatch install nor its ray. This writes ``vlbatch-caller-sites.pth`` into the
venv's purelib: one line per folder that ``site.addsitedir``s each of the caller's site-packages
folders the venv does not already have (addsitedir, not a bare path, so the caller's own
.pth files run too: editable installs rely on them). The venv's own packages (Airflow's
dependencies) stay first on sys.path, then the caller's, then the base interpreter's.
Rewritten on every call (idempotent), so it always points at the latest caller.
"""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

PTH_NAME = "vlbatch-caller-sites.pth"
_PROBE = "import json, site, sysconfig; print(json.dumps([sysconfig.get_paths()['purelib'], site.getsitepackages()]))"


def caller_sites() -> list[str]:
    """This interpreter's site-packages folders, in sys.path order (user site last, if enabled)."""
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and os.path.isdir(user):
        dirs.append(user)
    return dirs


def link(venv: Path) -> Path:
    """Write the .pth into `venv`; returns its path."""
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", _PROBE], check=True, capture_output=True, text=True)
    purelib, venv_sites = json.loads(probe.stdout)
    have = {os.path.realpath(d) for d in venv_sites}
    extra = [d for d in caller_sites() if os.path.realpath(d) not in have]
    pth = Path(purelib) / PTH_NAME
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in extra))
    return pth


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} VENV_DIR")
    print(link(Path(sys.argv[1])))
