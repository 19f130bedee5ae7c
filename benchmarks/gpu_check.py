"""The pieces benchmarks/gpu_run.sh needs, checked in one line (its first step).

    python3 -m benchmarks.gpu_check [--cpu] [--json FILE]

Prints one line: Python, torch (its CUDA, the device and its free memory), triton,
transformers (and whether it has Qwen3.5: the parity reference), numba, the carried wheels
(fla-core, einops, blake3, xgrammar: what the device's python3 lacks) and this project's import from
the tree, then `missing: ...` naming what is absent. Exits 1 when something every step
needs is missing (`--cpu`, the rehearsal: CUDA and fla are not needed). Not fatal, only named:
fla on CUDA (the DeltaNet layers then run the torch kernels) and a transformers without
Qwen3.5 (parity and the transformers baseline then fail; the engine's figures still come).
Standard library at the top level: it must run where torch itself is missing.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import platform
import sys

# import name -> distribution; every step imports these
NEEDED = {"torch": "torch", "numpy": "numpy", "safetensors": "safetensors", "tokenizers": "tokenizers",
          "jinja2": "jinja2", "PIL": "pillow", "yaml": "pyyaml", "numba": "numba", "triton": "triton",
          "transformers": "transformers", "blake3": "blake3"}
CARRIED = ("fla-core", "einops", "blake3", "xgrammar")  # the wheels benchmarks/gpu_wheels.sh downloads


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _importable(name: str) -> str | None:
    """None when `name` imports, else the error's one-line form."""
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 (any failure is what the line reports)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def check(cpu: bool) -> dict:
    """{"line": str, "missing": [...], "fatal": bool, and the figures}."""
    missing, fatal, parts = [], False, [f"python {platform.python_version()}"]
    for name, dist in NEEDED.items():
        err = _importable(name)
        if err is not None:
            missing.append(f"{dist} ({err})")
            fatal = True
    info: dict = {"python": platform.python_version(), "versions": {d: _version(d) for d in NEEDED.values()}}
    if "torch" not in " ".join(missing):
        import torch

        cuda = torch.cuda.is_available()
        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=cuda)
        if cuda:
            free, total = torch.cuda.mem_get_info()
            info.update(device=torch.cuda.get_device_name(), free_gib=free / 2**30, total_gib=total / 2**30)
            parts.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}, {info['device']}, "
                         f"{info['free_gib']:.1f} GiB free of {info['total_gib']:.1f})")
        else:
            parts.append(f"torch {torch.__version__} (no CUDA device)")
            if not cpu:
                missing.append("a CUDA device (torch.cuda.is_available() is False)")
                fatal = True
    for dist in ("triton", "transformers", "numba"):
        if _version(dist) is None:
            continue
        part = f"{dist} {_version(dist)}"
        if dist == "transformers" and _importable("transformers") is None:
            has = _importable("transformers.models.qwen3_5") is None
            info["transformers_has_qwen3_5"] = has
            part += f" (Qwen3.5: {'yes' if has else 'no'})"
            if not has:  # not fatal: the engine's own figures still come; parity and the baseline fail
                missing.append("transformers with Qwen3.5 (the parity reference and the 9B baseline)")
        parts.append(part)
    carried = {d: _version(d) for d in CARRIED}
    info["carried"] = carried
    parts.append("carried: " + ", ".join(f"{d} {v or '-'}" for d, v in carried.items()))
    if not cpu and _importable("fla") is not None:
        missing.append("fla-core (+ einops) wheels: DeltaNet runs the torch kernels, no fla check")
    err = _importable("vlbatch.operators.engine")
    parts.append("vlbatch from the tree: " + ("ok" if err is None else err))
    if err is not None and not fatal:
        missing.append(f"vlbatch ({err})")
        fatal = True
    line = "; ".join(parts) + "; missing: " + (", ".join(missing) or "none")
    return {**info, "line": line, "missing": missing, "fatal": fatal}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU rehearsal: no CUDA device or fla needed")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = check(args.cpu)
    print(res["line"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["fatal"] else 0


if __name__ == "__main__":
    sys.exit(main())
