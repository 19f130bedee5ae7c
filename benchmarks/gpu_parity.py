"""Greedy parity of our engine with transformers on the tiny dense, tied and MoE checkpoints
(the first step of benchmarks/gpu_run.sh).

    python3 -m benchmarks.gpu_parity [--device cuda] [--dtype bfloat16] [--new-tokens 32] [--json FILE]

Each variant's checkpoint is written here by `make_tiny_checkpoint` (transformers' own
classes, random weights) and loaded by both sides in `--dtype` on `--device`. The prompts
(one image, one video) go through our processor, bit-identical to the reference's (its
tests), so transformers' image processor (torchvision) is not needed; transformers gets the
same input_ids, pixels and grids and runs `generate` (greedy, the checkpoint's eos), the
engine runs them with its defaults for the device. Per case: same tokens, or the first
position where they part with both models' logits there for both tokens (each model run
on the prompt + the common prefix) and whether the reference's gap between the two is a
near-tie: at most `TIE_EPS` machine epsilons of `--dtype` times the larger |logit| (bf16
rounding can flip such an argmax; a larger gap is a parity failure, exit 1).
The transformers version compared against is printed and recorded.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

VARIANTS = ("dense", "dense_tied", "moe")
TIE_EPS = 8


def _inputs(proc, kind: str, seed: int) -> dict:
    """Our processor's output (numpy) for one image or video prompt."""
    from vlbatch.operators.types import VideoClip

    rng = np.random.default_rng(seed)
    msgs = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Describe this."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    if kind == "image":
        return proc(text=text, images=[rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)])
    frames = rng.integers(0, 256, (8, 64, 96, 3), dtype=np.uint8)
    return proc(text=text, videos=[VideoClip(frames, 2.0, 8, tuple(range(8)))])


def _ref_kwargs(enc: dict, device: str, extra: list[int] = ()) -> dict:
    """transformers' inputs: the prompt (+ `extra` tokens appended) as torch tensors on `device`."""
    out = {k: torch.from_numpy(np.asarray(v)).to(device) for k, v in enc.items()
           if k not in ("position_ids", "rope_deltas")}
    if extra:
        add = torch.tensor([list(extra)], dtype=out["input_ids"].dtype, device=device)
        out["input_ids"] = torch.cat([out["input_ids"], add], dim=1)
        out["attention_mask"] = torch.cat([out["attention_mask"], torch.ones_like(add)], dim=1)
        out["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"], torch.zeros_like(add)], dim=1)
    return out


def _last_logits(ref, ours, enc: dict, device: str, prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' float32 logits [V] for the token after prompt + `prefix`."""
    kw = _ref_kwargs(enc, device, prefix)
    with torch.no_grad():
        r = ref(**kw, logits_to_keep=1).logits[0, -1].float()
    o = ours(**{k: v for k, v in kw.items() if k != "attention_mask"}, logits_to_keep=1)[0, -1].float()
    return r, o


def _divergence(ref, engine, enc, device, dtype, mine: list[int], theirs: list[int]) -> dict | None:
    """None when the token lists are equal, else the first position where they part, the
    logits there and the near-tie verdict."""
    if mine == theirs:
        return None
    i = next((j for j, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
    if i >= min(len(mine), len(theirs)):  # one stopped (eos) where the other went on: that is not a near-tie
        return {"position": i, "ours_len": len(mine), "ref_len": len(theirs), "near_tie": False}
    r, o = _last_logits(ref, engine.model, enc, device, theirs[:i])
    a, b = theirs[i], mine[i]
    gap = float(r[a] - r[b])
    tol = TIE_EPS * torch.finfo(dtype).eps * max(1.0, abs(float(r[a])), abs(float(r[b])))
    return {"position": i, "ref_token": a, "ours_token": b,
            "ref_logits": {"ref_token": float(r[a]), "ours_token": float(r[b])},
            "ours_logits": {"ref_token": float(o[a]), "ours_token": float(o[b])},
            "ref_gap": gap, "tolerance": tol, "near_tie": abs(gap) <= tol}


def run_variant(variant: str, root: Path, device: str, dtype: torch.dtype, new_tokens: int) -> list[dict]:
    from transformers import AutoModelForImageTextToText

    from vlbatch.devtools.checkpoints import make_tiny_checkpoint
    from vlbatch.operators.engine import Engine, Request, SamplingParams
    from vlbatch.operators.preprocess import Processor

    ckpt = make_tiny_checkpoint(root / variant, variant)
    ref = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=dtype).to(device).eval()
    engine = Engine.from_pretrained(ckpt, device=device, dtype=dtype, kv_budget_bytes=32 << 20)
    proc = Processor.from_pretrained(ckpt)
    cases = []
    for seed, kind in enumerate(("image", "video")):
        enc = _inputs(proc, kind, seed)
        with torch.no_grad():
            seq = ref.generate(**_ref_kwargs(enc, device), max_new_tokens=new_tokens, do_sample=False)
        theirs = seq[0, enc["input_ids"].shape[1]:].tolist()
        (res,) = engine.generate([Request.from_processor(f"{variant}-{kind}", enc,
                                                         sampling=SamplingParams(max_new_tokens=new_tokens))])
        mine = list(res.token_ids)
        div = _divergence(ref, engine, enc, device, dtype, mine, theirs)
        cases.append({"variant": variant, "prompt": kind, "tokens": len(theirs), "same": div is None,
                      "first_divergence": div})
        print(f"  {variant}/{kind}: " + ("same tokens" if div is None else f"parted at {json.dumps(div)}")
              + f" ({len(theirs)} tokens)", flush=True)
    return cases


def main(argv=None) -> int:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"greedy parity against transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{args.dtype} on {args.device}, {args.new_tokens} new tokens", flush=True)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            cases += run_variant(variant, Path(tmp), args.device, dtype, args.new_tokens)
    parted = [c for c in cases if not c["same"]]
    verdict = ("same tokens" if not parted else "parted at near-ties only"
               if all(c["first_divergence"]["near_tie"] for c in parted) else "DIVERGED")
    print(f"parity: {verdict} ({len(cases) - len(parted)} of {len(cases)} cases identical)")
    if args.json:
        Path(args.json).write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                                               "device": args.device, "dtype": args.dtype, "verdict": verdict,
                                               "cases": cases}, indent=1))
    return 1 if verdict == "DIVERGED" else 0


if __name__ == "__main__":
    raise SystemExit(main())
