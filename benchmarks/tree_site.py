"""Make `vlbatch.*` importable from a copied working tree, without installing anything.

    python3 benchmarks/tree_site.py SITE [WHEEL ...]   # then: PYTHONPATH=SITE python3 -c "import vlbatch.operators"

setup.py maps the repository's folders into one namespace (`vlbatch.operators` is
`operators/`, `vlbatch.devtools` is `scripts/devtools/`; its `ROOTS`). This writes SITE/vlbatch/
holding one symlink per entry of that mapping, read from setup.py's source (not imported:
that needs setuptools), so SITE on PYTHONPATH gives the installed import names over the
tree itself: edits in the tree are seen at once, and `vlbatch` stays an implicit namespace
package as installed.

Why not `pip install --no-deps --no-build-isolation --no-index -e .`: it needs setuptools
>= 68 in the interpreter (a Python 3.12 venv has none), writes into that interpreter's
site-packages and an egg-info into the tree. Why not a .pth file: it can only add folders
to sys.path, not map `vlbatch.operators` onto `operators/`; a meta-path finder could, but a
folder of symlinks does the same with nothing executed at start-up. Standard library only.

WHEELs given (the carried ones: fla-core, einops, blake3) are unzipped into SITE too: for a
wheel without a `.data` folder (no scripts, headers or data files) the unzip is the install;
one with a `.data` folder is refused, naming it.
"""
from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def roots(setup_py: Path = ROOT / "setup.py") -> dict[str, str]:
    """setup.py's `ROOTS = {...}` literal: import name under vlbatch -> folder in the tree."""
    for node in ast.parse(setup_py.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{setup_py} assigns no ROOTS literal")


def make_site(site: Path, root: Path = ROOT) -> Path:
    """SITE/vlbatch/<name> -> root/<folder> for every ROOTS entry; returns SITE."""
    pkg = Path(site) / "vlbatch"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, folder in roots(root / "setup.py").items():
        link = pkg / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to((root / folder).resolve(), target_is_directory=True)
    return Path(site)


def unpack_wheels(site: Path, wheels: list[Path]) -> list[str]:
    """Unzip each wheel into SITE; returns their file names. A wheel with a `.data` folder
    raises ValueError (it needs a real installer)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if any(n.split("/", 1)[0].endswith(".data") for n in zf.namelist()):
                raise ValueError(f"{wheel} has a .data folder: install it with pip instead")
            zf.extractall(site)
    return [Path(w).name for w in wheels]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python3 benchmarks/tree_site.py SITE [WHEEL ...]")
    print(make_site(Path(sys.argv[1])))
    for name in unpack_wheels(Path(sys.argv[1]), [Path(w) for w in sys.argv[2:]]):
        print(f"unpacked {name}")
