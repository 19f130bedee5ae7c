"""`python -m vlbatch.operators.parallel --shape 9b --tp 2 --gpu-gib 80 --context 8192`: per-rank
weight, KV-per-token and state-per-sequence bytes and the largest batch that fits.
`--shape all` prints every size in `memory_plan.SHAPES`; `--config` reads a config.json instead."""
from __future__ import annotations

import argparse
import sys

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model.config import ModelConfig
from vlbatch.operators.model.loader import torch_dtype
from vlbatch.operators.parallel.memory_plan import SHAPES, memory_plan

GIB = 1 << 30


def _report(name: str, config: ModelConfig, args) -> str:
    try:
        mp = memory_plan(config, args.tp, args.expert_parallel, torch_dtype(args.dtype))
    except ConfigError as exc:
        return f"{name}: tp={args.tp}: refused: {exc}"
    batch = mp.max_batch(int(args.gpu_gib * GIB), args.context, int(args.reserve_gib * GIB))
    return (f"{name}: tp={args.tp} ep={args.expert_parallel} per rank: weights {mp.weight_bytes / GIB:.2f} GiB, "
            f"KV {mp.kv_bytes_per_token} B/token, state {mp.state_bytes_per_seq / (1 << 20):.2f} MiB/seq; "
            f"max batch at {args.context} tokens in {args.gpu_gib:g} GiB: {batch}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlbatch.operators.parallel", description=__doc__)
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--config", help="a config.json (or its folder) instead of --shape")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-gib", type=float, default=80.0)
    ap.add_argument("--reserve-gib", type=float, default=4.0, help="activations, workspace, CUDA context")
    ap.add_argument("--context", type=int, default=8192, help="tokens per sequence (prompt + output)")
    args = ap.parse_args(argv)
    try:
        if args.config:
            from pathlib import Path

            path = Path(args.config)
            print(_report(str(path), ModelConfig.from_pretrained(path.parent if path.is_file() else path), args))
            return 0
        for name in SHAPES if args.shape == "all" else [args.shape]:
            raw, source = SHAPES[name]
            if raw is None:
                print(f"{name}: shape {source}")
                continue
            print(_report(name, ModelConfig.from_dict(raw), args) + f"  [sizes: {source}]")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
