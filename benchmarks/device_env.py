"""A Python environment holding only what a lent device machine's python3 holds, for
rehearsing `benchmarks/gpu_run.sh` on the CPU.

    python3 -m benchmarks.device_env DIR     # then: PATH=DIR/bin:$PATH bash benchmarks/gpu_run.sh --rehearse

The device machine's python3 (as last read, issue 30) has torch, transformers, triton,
numba, numpy, pillow, safetensors, tokenizers, jinja2, pyarrow, fsspec and pyyaml: no
ray, pydantic, decord, av, s3fs, blake3, and not this project. `build(DIR)` makes a venv
without system site-packages and links into its site-packages exactly those distributions
and their dependencies (requirement markers evaluated, no extras), taken from this
interpreter's installs: nothing is downloaded, and it takes a second. What the device
lacks stays missing here, so a step that imports ray fails the rehearsal as it would
fail on the device. (A folder several distributions share, such as `nvidia/`, is linked
whole: packages of the closure's namespaces come along; none of the absent ones live there.)

`wheel_from_installed(name, dest)` packs an installed distribution back into a wheel, so
a rehearsal can carry a wheel (blake3) the way the device run carries downloaded ones.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DEVICE_PACKAGES = ("torch", "transformers", "triton", "numba", "numpy", "pillow", "safetensors", "tokenizers",
                   "jinja2", "pyarrow", "fsspec", "pyyaml")
# What the device lacks: never linked, even where a dependency names it (this host's typer
# requires pydantic; the device's transformers imports without it, and so does this host's).
ABSENT = frozenset({"ray", "pydantic", "pydantic-core", "decord", "av", "s3fs", "blake3"})


def closure(names=DEVICE_PACKAGES, absent=ABSENT) -> list[md.Distribution]:
    """The installed distributions `names` need: themselves and their dependencies, transitively
    (markers evaluated for this interpreter, extras not followed), less `absent`. A missing
    one raises PackageNotFoundError, naming it."""
    env, seen, todo, out = default_environment(), set(), list(names), []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in absent:
            continue
        seen.add(name)
        dist = md.distribution(name)
        out.append(dist)
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                todo.append(req.name)
    return out


def top_level(dist: md.Distribution) -> set[str]:
    """The entries a distribution puts directly in site-packages (packages, modules, .pth
    files, its .dist-info), from its RECORD."""
    if dist.files is None:
        raise RuntimeError(f"{dist.metadata['Name']} has no RECORD: cannot tell its files")
    return {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__") and len(f.parts) > 0}


def build(dest: Path, names=DEVICE_PACKAGES) -> Path:
    """A venv at `dest` (no system site-packages) whose site-packages links exactly the
    closure of `names` from this interpreter's installs; returns its python."""
    dest = Path(dest)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python3"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in closure(names):
        for entry in top_level(dist):
            src, link = Path(dist.locate_file(entry)), site / entry
            if src.exists() and not link.exists():
                link.symlink_to(src)
    return python


def wheel_from_installed(name: str, dest: Path) -> Path:
    """The installed distribution `name` packed as a wheel in `dest` (its RECORD's files
    inside site-packages, as installed; enough for an unzip-style install)."""
    dist = md.distribution(name)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    norm = canonicalize_name(dist.metadata["Name"]).replace("-", "_")
    path = Path(dest) / f"{norm}-{dist.version}-{tag}-{tag}-linux_x86_64.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for f in dist.files or ():
            src = Path(dist.locate_file(f))
            if f.parts[0] not in ("..",) and "__pycache__" not in f.parts and src.is_file():
                zf.write(src, str(f))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", help="folder of the new venv")
    ap.add_argument("--wheels", default=None, help="also pack the installed blake3 as a wheel into this folder")
    args = ap.parse_args(argv)
    print(build(Path(args.dest)))
    if args.wheels:
        print(wheel_from_installed("blake3", Path(args.wheels)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
