"""Our swappable kernels against their references on the device (the second step of
benchmarks/gpu_run.sh).

    python3 -m benchmarks.gpu_kernels [--device cuda] [--json FILE]

- gated delta rule (`check.compare_with_torch`: packed prefill and in-place decode from random
  states against the torch kernels in float32 on the CPU): fla's Triton kernels (CUDA, when
  the carried fla-core is importable), the torch kernels on the device, the naive loop;
  float32 and bfloat16 inputs;
- paged decode attention: the Triton kernel against the naive reference at odd shapes
  (`attention/check.py`; on the CPU only under TRITON_INTERPRET=1, which gpu_run.sh sets);
- MoE routed experts: the grouped matmul (where `torch._grouped_mm` takes the dtype on the
  device) and the padded bmm against the per-expert loop.
Prints the largest |difference| of each and ok / FAIL against `TOLERANCE`; exit 1 on a FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

TOLERANCE = {"float32": 2e-3, "bfloat16": 1e-1}  # over outputs / states of magnitude ~1


def delta_rule(device: str) -> dict:
    from vlbatch.operators.kernels.delta_rule import select_delta_rule
    from vlbatch.operators.kernels.delta_rule.check import compare_with_torch
    from vlbatch.operators.kernels.delta_rule.fla_rule import fla_installed
    from vlbatch.operators.kernels.delta_rule.naive import NaiveDeltaRule

    impls = {"torch": (select_delta_rule(device, "torch"), device), "naive": (NaiveDeltaRule(), "cpu")}
    if torch.device(device).type == "cuda" and fla_installed():
        impls["fla"] = (select_delta_rule(device, "fla"), device)
    out = {}
    for name, (kernels, dev) in impls.items():
        dtypes = (torch.float32,) if name == "naive" else (torch.float32, torch.bfloat16)
        for dt in dtypes:
            out[f"{name}/{str(dt).removeprefix('torch.')}"] = compare_with_torch(kernels, dev, dt)
    return out


def attention(device: str) -> dict:
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "the Triton kernel runs on the CPU only under TRITON_INTERPRET=1"}
    from vlbatch.operators.kernels.attention.check import compare_triton_with_naive

    return {f"triton/{k}": {"out": v} for k, v in compare_triton_with_naive(device).items()}


def experts(device: str, shapes=((37, 4, 6, 24, 20), (64, 8, 16, 32, 8), (300, 8, 64, 256, 128))) -> dict:
    from vlbatch.operators.kernels.moe.grouped import GroupedMMExperts, grouped_mm_supported
    from vlbatch.operators.kernels.moe.naive import LoopExperts
    from vlbatch.operators.kernels.moe.padded import PaddedExperts

    out = {}
    for dt in (torch.float32, torch.bfloat16):
        errs: dict[str, float] = {}
        for t, k, e, d, inner in shapes:
            gen = torch.Generator().manual_seed(t)
            index = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices
            weight = torch.rand(t, k, generator=gen)
            args = [torch.randn(t, d, generator=gen), index, weight / weight.sum(-1, keepdim=True),
                    torch.randn(e, 2 * inner, d, generator=gen) * d**-0.5,
                    torch.randn(e, d, inner, generator=gen) * inner**-0.5]
            args = [a.to(device, dt) if a.is_floating_point() else a.to(device) for a in args]
            ref = LoopExperts()(*[a.double() if a.is_floating_point() else a for a in args], F.silu)
            impls = {"padded": PaddedExperts()}
            if grouped_mm_supported(torch.device(device), dt, d, inner):
                impls["grouped_mm"] = GroupedMMExperts()
            for name, impl in impls.items():
                err = float((impl(*args, F.silu).double() - ref).abs().max())
                errs[name] = max(errs.get(name, 0.0), err)
        for name, err in errs.items():
            out[f"{name}/{str(dt).removeprefix('torch.')}"] = {"out": err}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"kernels against their references on {args.device} (torch {torch.__version__})", flush=True)
    res, failed = {}, []
    for part, fn in (("delta_rule", delta_rule), ("attention", attention), ("moe", experts)):
        res[part] = fn(args.device)
        for name, errs in res[part].items():
            if name == "skipped":
                print(f"  {part}: skipped ({errs})")
                continue
            tol = TOLERANCE[name.rsplit("/", 1)[1]]
            bad = [k for k, v in errs.items() if not v <= tol]  # NaN fails too
            failed += [f"{part}/{name}/{k}" for k in bad]
            print(f"  {part} {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
                  + (f": FAIL (over {tol:.0e})" if bad else ": ok"), flush=True)
    res["failed"] = failed
    print(f"kernels: {'ok' if not failed else 'FAIL: ' + ', '.join(failed)}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
