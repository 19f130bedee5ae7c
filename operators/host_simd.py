"""The vector width the compiled CPU kernels (numba) are built for, chosen per machine by timing.

LLVM, under numba, picks a preferred SIMD width from the CPU model: on Intel cores with AVX-512
it prefers 256-bit registers (its tuning for Skylake-SP and later, `prefer-256-bit`; LLVM review
D67259), on AMD Zen 4 512-bit. Our kernels (the delta-rule scan and decode step, paged decode
attention, RMSNorm, the causal conv, the q / k heads) are loops over rows of 64-256 floats in L1,
whose speed at either width is a property of the machine, not of the vendor's default (on an AMD
EPYC Zen 4 the two builds time within 3 % of each other in cache, while bench (a)'s decode state
and attention phases ran 10-25 % slower at 256-bit; the Intel Xeon's 512-bit figures are to come).

`use_fastest_simd()` times `engine/simd_probe.py`'s kernels at both widths once per machine (subprocesses:
a process compiles at one width; ~35 s the first time, while numba compiles both builds, ~17 s
once they are in numba's cache), keeps the choice in `~/.cache/vlbatch/simd.json` keyed by CPU,
its features and the numba version, and where the faster width is not LLVM's own choice sets
NUMBA_CPU_FEATURES to the host's features plus `+prefer-256-bit` / `-prefer-256-bit`. The
other width must be `MARGIN` faster to be taken (the probe's run-to-run noise).

Process-wide, as numba's code generator is, and effective only before the process defines its
first compiled function (importing `vlbatch.operators.engine` or `.model` does: numba sets its code
generator up then), so this module imports none of ours, and the process owner calls it first
(the pipeline's model actor on a CPU device, `bench_engine`), like `engine/host_memory.py`'s
`retain_freed_memory`; the engine never does. Called too late, it changes nothing and says so.
VLBATCH_SIMD=off keeps numba's own choice (the test suite's setting), =256 / =512 fixes one
without a probe; a NUMBA_CPU_FEATURES already set by the user is left alone.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MARGIN = 0.9  # the non-default width is taken when its probe time is below MARGIN x the default's
ROUNDS = 2  # probe processes per width, alternating; the best of them counts (simd_probe: why)
FLAGS = {256: "+prefer-256-bit", 512: "-prefer-256-bit"}
DEFAULT_CACHE = "~/.cache/vlbatch/simd.json"
PROBE_VERSION = 2  # part of the cache key: raise it when simd_probe's workload changes


@dataclass(frozen=True)
class SimdChoice:
    """width: the SIMD width numba compiles our kernels for (None: numba's own choice, unknown or
    not asked); default: LLVM's own width here (probed); probe_ms: total probe milliseconds per
    width; source: probed, cached, off, fixed, user, one width (no AVX-512), probe failed: <error>;
    applied: whether this process's NUMBA_CPU_FEATURES was set from it."""

    width: int | None
    default: int | None = None
    probe_ms: dict[int, float] = field(default_factory=dict)
    source: str = "probed"
    applied: bool = False

    def describe(self) -> str:
        """One line for logs and benchmarks."""
        head = "SIMD width of the compiled CPU kernels:"
        if self.width is None:
            return f"{head} numba's own ({self.source})"
        if self.default is None:
            return f"{head} {self.width}-bit ({self.source}, VLBATCH_SIMD)"
        probe = ", ".join(f"{w}-bit {ms:.1f} ms" for w, ms in sorted(self.probe_ms.items()))
        return f"{head} {self.width}-bit ({self.source}; LLVM's default here {self.default}-bit; probe: {probe})"


def host_features() -> str:
    """The host CPU's LLVM feature string, as numba uses it by default."""
    from numba.core.codegen import get_host_cpu_features

    return get_host_cpu_features()


def machine_key() -> str:
    """CPU name + a digest of its features + the numba version + the probe's: what a choice is valid for."""
    import llvmlite.binding as ll
    import numba

    digest = hashlib.sha256(host_features().encode()).hexdigest()[:16]
    return f"{ll.get_host_cpu_name()}-{digest}-numba{numba.__version__}-probe{PROBE_VERSION}"


def _run_probe(width: int | None) -> dict:
    """One `simd_probe` subprocess at `width` (None: numba's default) -> its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    if width is not None:
        env["NUMBA_CPU_FEATURES"] = f"{host_features()},{FLAGS[width]}"
    out = subprocess.run([sys.executable, "-m", "vlbatch.operators.engine.simd_probe"], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe_widths(rounds: int = ROUNDS) -> SimdChoice:
    """Time both widths (`rounds` alternating runs each, best counts) -> the choice."""
    first = _run_probe(None)
    default = first["width"]
    other = 256 if default == 512 else 512
    totals = {default: [sum(first["ms"].values())], other: []}
    for i in range(2 * rounds - 1):
        width = other if i % 2 == 0 else default
        run = _run_probe(width)
        totals[width].append(sum(run["ms"].values()))
    best = {w: min(ts) for w, ts in totals.items()}
    width = other if best[other] < MARGIN * best[default] else default
    return SimdChoice(width, default, best, "probed")


def choose_simd(cache: str | os.PathLike = DEFAULT_CACHE) -> SimdChoice:
    """The width for this machine: VLBATCH_SIMD (off / 256 / 512), else the cached choice, else
    probed and cached. A cache folder that cannot be written or a probe that fails leaves numba's
    own width (logged), never an error: the kernels are right at either width."""
    mode = os.environ.get("VLBATCH_SIMD", "auto").strip().lower()
    if mode == "off":
        return SimdChoice(None, source="off")
    if mode in ("256", "512"):
        return SimdChoice(int(mode), source="fixed")
    if mode != "auto":
        raise ValueError(f"VLBATCH_SIMD={mode!r}: expected auto, off, 256 or 512")
    if "+avx512f" not in host_features().split(","):
        return SimdChoice(None, source="one width")
    try:
        return _cached_or_probed(Path(cache).expanduser())
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:  # never fails the caller
        log.warning("SIMD width probe or its cache failed (%s): numba's own width", exc)
        return SimdChoice(None, source=f"probe failed: {type(exc).__name__}")


def _cached_or_probed(path: Path) -> SimdChoice:
    """The choice cached in `path` for this machine, else probed and cached there (under a file
    lock: processes starting together probe once). A cache that does not parse is probed over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = machine_key()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            table = json.loads(path.read_text()) if path.exists() else {}
            row = table.get(key) if isinstance(table, dict) else None
            if row is not None:
                return SimdChoice(int(row["width"]), int(row["default"]),
                                  {int(w): float(ms) for w, ms in row["probe_ms"].items()}, "cached")
        except (ValueError, KeyError, TypeError, AttributeError):
            table = {}
        choice = probe_widths()
        table[key] = {"width": choice.width, "default": choice.default, "probe_ms": choice.probe_ms}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    return choice


def codegen_started() -> bool:
    """Whether this process's numba has set up its CPU code generator (then its width is fixed:
    the first compiled function defined in the process sets it up)."""
    from numba.core.registry import cpu_target

    return "_toplevel_target_context" in cpu_target.__dict__


def use_fastest_simd(cache: str | os.PathLike = DEFAULT_CACHE) -> SimdChoice:
    """Choose (`choose_simd`) and set NUMBA_CPU_FEATURES for this process where the choice is not
    LLVM's default -> the choice, `applied` when the variable was set. Call before anything in
    the process compiles or loads a numba kernel."""
    if "NUMBA_CPU_FEATURES" in os.environ:
        return SimdChoice(None, source="user")
    choice = choose_simd(cache)
    if choice.width is None or choice.width == choice.default:
        return choice
    if codegen_started():
        log.warning("%s: not applied, numba compiled before use_fastest_simd was called", choice.describe())
        return choice
    os.environ["NUMBA_CPU_FEATURES"] = f"{host_features()},{FLAGS[choice.width]}"
    from numba.core import config

    config.reload_config()  # numba read its environment at import: read it again
    return SimdChoice(choice.width, choice.default, choice.probe_ms, choice.source, applied=True)
