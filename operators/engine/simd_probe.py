"""The compiled CPU kernels timed at the vector width this process's numba compiles for.

`python -m vlbatch.operators.engine.simd_probe` prints one JSON line,
`{"width": 512 or 256, "ms": {kernel: best milliseconds}}`: the width is read off the machine
code of a small loop compiled here (zmm registers or not), the times are the engine's compiled
kernels on synthetic inputs shaped like a decode step of 16 sequences and a packed prefill (head
dims 64 and 128: a small and a real Qwen3.5 DeltaNet head), with working sets of 1-2 MiB, so that
they time the code and not the memory (the same at either width).
`host_simd.py` runs it in processes of each width (NUMBA_CPU_FEATURES), alternating, and keeps
the faster; a process has one width (numba's code generator is set up once), hence the
subprocesses. One process's kernels can all run ~25 % slower than another's on the same machine
(where the JIT code lands: torch's sgemm timed beside them does not move), so a width counts by
its best process.
"""
from __future__ import annotations

import json
import time

import numpy as np
import torch
from numba import njit

REPEATS = 30
MIN_MS = 60.0


@njit(cache=False)
def _axpy(a, x, y):  # pragma: no cover - compiled; only its machine code is read
    for i in range(x.shape[0]):
        y[i] += a * x[i]


def compiled_width() -> int:
    """512 when numba's vectorised loops use zmm registers here, else 256."""
    x = np.ones(256, np.float32)
    _axpy(np.float32(2.0), x, x.copy())
    asm = _axpy.inspect_asm(_axpy.signatures[0])
    return 512 if "zmm" in asm else 256


def _best_ms(fn) -> float:
    """The best of `REPEATS` runs (at least `MIN_MS` of them in all), in this thread's CPU time:
    other processes' time slices do not count (a model actor probes while the job's other actors
    work beside it); the best of many is the process's own speed (a few are not: noise)."""
    fn()  # compiles or loads the kernel, warms caches
    best, spent, runs = float("inf"), 0.0, 0
    while runs < REPEATS or spent < MIN_MS / 1e3:
        start = time.thread_time()
        fn()
        took = time.thread_time() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return 1e3 * best


def _delta_rule(d: int, heads: int) -> dict[str, float]:
    from vlbatch.operators.kernels.delta_rule import cpu_decode, cpu_scan, tuning

    q, k, v, g, beta, state, lens = tuning.probe_problem(heads, d, d)  # 212 packed tokens
    pool = torch.randn(24, heads, d, d) * 0.1  # in L2 or close: the code's speed, not the memory's
    slots = torch.randperm(24)[:16]
    qd, kd, vd = (torch.randn(16, heads, d) for _ in range(3))
    gd, bd = -torch.rand(16, heads), torch.rand(16, heads)
    return {f"scan d{d}": _best_ms(lambda: cpu_scan.prefill_scan_cpu(q, k, v, g, beta, state, lens)),
            f"decode state d{d}": _best_ms(lambda: cpu_decode.decode_step_slots_cpu_(qd, kd, vd, gd, bd, pool,
                                                                                     slots))}


def _attention(d: int) -> float:
    from vlbatch.operators.kernels.attention.cpu_decode import paged_decode_cpu

    b, bs, width = 16, 16, 8  # K / V 1 MiB at d = 128
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(b * width, bs, 2, d, generator=gen) for _ in range(2))
    tables = torch.randperm(b * width, generator=gen).view(b, width).to(torch.int32)
    lens = torch.randint(64, bs * width, (b,), generator=gen, dtype=torch.int32)
    q = torch.randn(b, 8, d, generator=gen)
    return _best_ms(lambda: paged_decode_cpu(q, kc, vc, tables, lens))


def _row_ops() -> dict[str, float]:
    from vlbatch.operators.model.ops import conv_cpu, heads_cpu, norm_cpu

    x, w = torch.randn(64, 1024), torch.randn(1024)
    fused = torch.randn(512, 2048)[:, :1024]  # packed rows: a column view of a fused projection
    cw, states = torch.randn(1024, 4), torch.randn(64, 1024, 4)
    lens = (200, 150, 100, 62)
    return {"rms norm": _best_ms(lambda: [norm_cpu.rms_norm_cpu(x, w, 1e-6) for _ in range(8)]),
            "conv step": _best_ms(lambda: conv_cpu.conv1d_step_cpu(fused[:64], cw, states)),
            "conv packed": _best_ms(lambda: conv_cpu.conv1d_packed_cpu(fused, cw, states[:4], lens)),
            "q/k heads": _best_ms(lambda: heads_cpu.qk_heads_cpu(fused[:, :512], 2, 4, 128, 128 ** -0.5))}


def probe() -> dict:
    torch.set_num_threads(1)
    ms = {**_delta_rule(64, 8), **_delta_rule(128, 4), "attention d64": _attention(64),
          "attention d128": _attention(128), **_row_ops()}
    return {"width": compiled_width(), "ms": ms}


if __name__ == "__main__":
    print(json.dumps(probe()))
