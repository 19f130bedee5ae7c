"""The Triton paged-decode kernel (operators/kernels/attention/triton_decode.py) against the
naive reference at odd shapes, on the CPU through Triton's interpreter.

`TRITON_INTERPRET=1` must be set before triton decorates the kernel, so the comparison
(`operators/kernels/attention/check.py`, which benchmarks/gpu_kernels.py runs on CUDA) runs
in a child interpreter; the test asserts on its exit status and output. Shapes are small:
the interpreter runs each program in numpy (a few seconds here).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_triton_paged_decode_matches_naive_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "vlbatch.operators.kernels.attention.check", "cpu"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton paged decode on cpu: ok" in proc.stdout
