"""The Triton paged-decode kernel (operators/kernels/attention/triton_decode.py) against the
naive reference at odd shapes, on the CPU through Triton's interpreter.

`TRITON_INTERPRET=1` must be set before triton decorates the kernel, so the comparison runs
in a child interpreter (this file run as a script); the test asserts on its exit status and
output. Shapes are small: the interpreter runs each program in numpy (a few seconds here).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

CASES = [  # block_size, H_q, H_kv, D, (cached, new) per sequence
    (4, 4, 2, 8, [(5, 1), (13, 1), (0, 1), (2, 1)]),
    (3, 6, 3, 5, [(7, 1), (0, 1), (10, 1)]),
    (16, 3, 1, 7, [(20, 1), (33, 1)]),
]


def _compare(device: str = "cpu") -> None:
    """Every case on `device` (cpu: under the interpreter; cuda: the compiled kernel)."""
    import torch

    from vlbatch.operators.kernels.attention import NaivePagedAttention, PagedLayout
    from vlbatch.operators.kernels.attention.triton_decode import TritonPagedAttention, paged_decode

    torch.manual_seed(0)
    for bs, hq, hkv, d, lens in CASES:
        rng = random.Random(bs)
        blocks = list(range(48))
        rng.shuffle(blocks)
        tables = [[blocks.pop() for _ in range(-(-(p + n) // bs) + 1)] for p, n in lens]  # one spare block each
        starts, ends = [p for p, _ in lens], [p + n for p, n in lens]
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            kc = torch.randn(48, bs, hkv, d).to(device, dtype)
            vc = torch.randn(48, bs, hkv, d).to(device, dtype)
            t = len(lens)
            q = torch.randn(t, hq, d).to(device, dtype)
            k, v = torch.randn(t, hkv, d).to(device), torch.randn(t, hkv, d).to(device)
            layout = PagedLayout.build(tables, starts, ends, bs, device)
            ref = NaivePagedAttention()(layout, kc.clone(), vc.clone(), q, k, v)
            kc2, vc2 = kc.clone(), vc.clone()
            out = TritonPagedAttention()(layout, kc2, vc2, q, k, v)
            assert out.dtype == torch.float32 and out.shape == (t, hq, d)
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
            # the kernel alone, over a table wider than needed (a static step's padding) and padded rows
            wide = torch.zeros(t + 1, 8, dtype=torch.int32, device=device)
            wide[:t, : layout.decode_tables.shape[1]] = layout.decode_tables
            lens_w = torch.cat([layout.decode_lens, torch.ones(1, dtype=torch.int32, device=device)])
            qw = torch.cat([q, torch.zeros(1, hq, d, dtype=dtype, device=device)])
            direct = paged_decode(qw, kc2, vc2, wide, lens_w)
            torch.testing.assert_close(direct[:t], ref, atol=tol, rtol=tol)
            assert torch.isfinite(direct[t]).all()
    print(f"triton paged decode on {device}: ok (float32 and bfloat16, {len(CASES)} odd shapes)")


def test_triton_paged_decode_matches_naive_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton paged decode on cpu: ok" in proc.stdout


if __name__ == "__main__":  # benchmarks/gpu_run.sh runs it with "cuda"
    _compare(sys.argv[1] if len(sys.argv) > 1 else "cpu")
