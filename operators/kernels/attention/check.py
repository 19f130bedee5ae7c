"""The Triton paged-decode kernel against the naive reference at odd shapes:
`compare_triton_with_naive(device)`. On the CPU it needs `TRITON_INTERPRET=1` set before
triton is first imported (so a fresh interpreter: `python -m vlbatch.operators.kernels.attention.check cpu`,
as tests/test_kernels_attention_triton.py runs it); on CUDA it runs the compiled kernel
(benchmarks/gpu_kernels.py). Imports nothing beyond torch and triton (a device machine
may have no pytest)."""
from __future__ import annotations

import random
import sys

import torch

CASES = [  # block_size, H_q, H_kv, D, (cached, new) per sequence
    (4, 4, 2, 8, [(5, 1), (13, 1), (0, 1), (2, 1)]),
    (3, 6, 3, 5, [(7, 1), (0, 1), (10, 1)]),
    (16, 3, 1, 7, [(20, 1), (33, 1)]),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def compare_triton_with_naive(device: str = "cpu") -> dict[str, float]:
    """Every case in float32 and bfloat16 on `device`: the largest |difference| to the naive
    reference of `TritonPagedAttention` and of `paged_decode` alone over a table wider than
    needed (a static step's padding) with a padded row -> {"float32": err, "bfloat16": err}.
    Raises AssertionError on a wrong shape / dtype, an error over `TOLERANCE`, or a
    non-finite padded row."""
    from vlbatch.operators.kernels.attention.layout import PagedLayout
    from vlbatch.operators.kernels.attention.naive import NaivePagedAttention
    from vlbatch.operators.kernels.attention.triton_decode import TritonPagedAttention, paged_decode

    torch.manual_seed(0)
    worst = {"float32": 0.0, "bfloat16": 0.0}
    for bs, hq, hkv, d, lens in CASES:
        rng = random.Random(bs)
        blocks = list(range(48))
        rng.shuffle(blocks)
        tables = [[blocks.pop() for _ in range(-(-(p + n) // bs) + 1)] for p, n in lens]  # one spare block each
        starts, ends = [p for p, _ in lens], [p + n for p, n in lens]
        for dtype, tol in TOLERANCE.items():
            kc = torch.randn(48, bs, hkv, d).to(device, dtype)
            vc = torch.randn(48, bs, hkv, d).to(device, dtype)
            t = len(lens)
            q = torch.randn(t, hq, d).to(device, dtype)
            k, v = torch.randn(t, hkv, d).to(device), torch.randn(t, hkv, d).to(device)
            layout = PagedLayout.build(tables, starts, ends, bs, device)
            ref = NaivePagedAttention()(layout, kc.clone(), vc.clone(), q, k, v)
            kc2, vc2 = kc.clone(), vc.clone()
            out = TritonPagedAttention()(layout, kc2, vc2, q, k, v)
            assert out.dtype == torch.float32 and out.shape == (t, hq, d), (out.dtype, out.shape)
            wide = torch.zeros(t + 1, 8, dtype=torch.int32, device=device)
            wide[:t, : layout.decode_tables.shape[1]] = layout.decode_tables
            lens_w = torch.cat([layout.decode_lens, torch.ones(1, dtype=torch.int32, device=device)])
            qw = torch.cat([q, torch.zeros(1, hq, d, dtype=dtype, device=device)])
            direct = paged_decode(qw, kc2, vc2, wide, lens_w)
            assert torch.isfinite(direct[t]).all(), "padded row not finite"
            for got in (out, direct[:t]):
                err = float((got.float() - ref.float()).abs().max())
                name = str(dtype).removeprefix("torch.")
                worst[name] = max(worst[name], err)
                assert err <= tol * (1 + float(ref.abs().max())), f"{name}: |diff| {err:.2e} over {tol:.0e}"
    return worst


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    errs = compare_triton_with_naive(device)
    print(f"triton paged decode on {device}: ok (float32 and bfloat16, {len(CASES)} odd shapes; largest |diff| "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + ")")
