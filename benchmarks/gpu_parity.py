"""Greedy parity of our engine with transformers on the tiny dense, tied and MoE checkpoints
(the first step of benchmarks/gpu_run.sh).

    python3 -m benchmarks.gpu_parity [--device cuda] [--dtype bfloat16] [--new-tokens 32] [--json FILE] [--report-only]

Each variant's checkpoint is written here by `make_tiny_checkpoint` (transformers' own
classes, random weights) and loaded by both sides in `--dtype` on `--device`. The prompts
(one image, one video) go through our processor, bit-identical to the reference's (its
tests), so transformers' image processor (torchvision) is not needed; transformers gets the
same input_ids, pixels and grids and runs `generate` (greedy, the checkpoint's eos), the
engine runs them with its defaults for the device. Per case:
- same tokens, or the first position where they part with both models' logits there for both
  tokens (teacher-forced on the reference's tokens) and whether it is a near-tie: the
  reference's gap at most `TIE_EPS` machine epsilons of `--dtype` times the larger |logit|, or,
  in an MoE model, a routing tie in our decode step (the k-th and (k+1)-th router
  probabilities within one epsilon: rounding picks either expert, seen on the CPU in bf16);
- the teacher-forced logits over prompt + the reference's tokens of our model and of
  transformers in `--dtype`, each against transformers in float32 (per position the max |diff|
  over the vocabulary; its median and max over the positions): ours must have a median within
  twice transformers' own plus max(1e-3, `TIE_EPS` eps) (the median, because a routing tie in an
  MoE model moves one position's logits by far more than rounding, on either side).
Verdict: `same tokens`, `parted at near-ties only`, or `DIVERGED` (exit 1): a non-tie parting or
logits off.
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


def _teacher_forced(ref, ref32, ours, enc: dict, device: str, theirs: list[int]) -> dict:
    """Logits at every generated position of prompt + the reference's tokens, from transformers in
    the run's dtype, transformers in float32 and our model in the run's dtype (one full forward
    each) -> {"ref": [n, V], "ref32": [n, V], "ours": [n, V]} float32; row j predicts token j."""
    kw = _ref_kwargs(enc, device, theirs[:-1])
    keep = torch.arange(enc["input_ids"].shape[1] - 1, kw["input_ids"].shape[1], device=device)
    with torch.no_grad():
        out = {"ref": ref(**kw).logits[0, keep].float(), "ref32": ref32(**kw).logits[0, keep].float()}
    out["ours"] = ours(**{k: v for k, v in kw.items() if k != "attention_mask"}, logits_to_keep=keep)[0].float()
    return out


def router_margin(model, enc: dict, device: str, prefix: list[int]) -> float | None:
    """MoE models: the smallest gap between the k-th and (k+1)-th router probability over the
    layers of our model's decode step that predicts the token after prompt + `prefix` (run
    incrementally, as the engine decodes), relative to the top probability; None for dense
    models. A gap of ~0 is a routing tie: bf16 rounding picks either expert, and the outputs
    part by far more than a logit near-tie."""
    from vlbatch.operators.model import ContiguousCache

    layers = [m for m in model.modules() if hasattr(m, "shared_expert_gate") and hasattr(m, "top_k")]
    if not layers or not prefix:
        return None
    seen: list[float] = []

    def hook(mod, inp, _out):
        p = torch.softmax(mod.gate(inp[0]), dim=-1, dtype=torch.float32).sort(-1, descending=True).values
        seen.append(float(((p[:, mod.top_k - 1] - p[:, mod.top_k]) / p[:, 0]).min()))

    kw = {k: v for k, v in _ref_kwargs(enc, device).items() if k != "attention_mask"}
    ids = kw.pop("input_ids")
    cache = ContiguousCache(model.config.text, 1, device=model.device, dtype=model.dtype,
                            capacity=ids.shape[1] + len(prefix))
    model(ids, cache=cache, logits_to_keep=1, **kw)
    for tok in prefix[:-1]:
        model(torch.tensor([[tok]], device=device), cache=cache, logits_to_keep=1)
    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        model(torch.tensor([[prefix[-1]]], device=device), cache=cache, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return min(seen)


def _divergence(logits: dict, model, enc, device, dtype, mine: list[int], theirs: list[int]) -> dict | None:
    """None when the token lists are equal, else the first position where they part, both
    models' logits there for both tokens (teacher-forced on the reference's tokens) and the
    near-tie verdict: the reference's gap within `TIE_EPS` eps of the logits, or a routing tie
    (relative router margin within one eps) in our MoE decode step."""
    if mine == theirs:
        return None
    i = next((j for j, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
    if i >= min(len(mine), len(theirs)):  # one stopped (eos) where the other went on: that is not a near-tie
        return {"position": i, "ours_len": len(mine), "ref_len": len(theirs), "near_tie": False}
    r, o = logits["ref"][i], logits["ours"][i]
    a, b = theirs[i], mine[i]
    gap, eps = float(r[a] - r[b]), torch.finfo(dtype).eps
    tol = TIE_EPS * eps * max(1.0, abs(float(r[a])), abs(float(r[b])))
    margin = router_margin(model, enc, device, theirs[:i])
    why = "logits" if abs(gap) <= tol else "router" if margin is not None and margin <= eps else None
    return {"position": i, "ref_token": a, "ours_token": b,
            "ref_logits": {"ref_token": float(r[a]), "ours_token": float(r[b])},
            "ours_logits": {"ref_token": float(o[a]), "ours_token": float(o[b])},
            "ref_gap": gap, "tolerance": tol, "router_margin": margin, "near_tie": why is not None, "tie": why}


def run_variant(variant: str, root: Path, device: str, dtype: torch.dtype, new_tokens: int) -> list[dict]:
    from transformers import AutoModelForImageTextToText

    from vlbatch.devtools.checkpoints import make_tiny_checkpoint
    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.factory import load_engine
    from vlbatch.operators.preprocess import Processor

    ckpt = make_tiny_checkpoint(root / variant, variant)
    ref = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=dtype).to(device).eval()
    ref32 = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=torch.float32).to(device).eval()
    engine = load_engine(ckpt, device=device, dtype=dtype, kv_budget_bytes=32 << 20)
    proc = Processor.from_pretrained(ckpt)
    add = max(1e-3, TIE_EPS * torch.finfo(dtype).eps)
    cases = []
    for seed, kind in enumerate(("image", "video")):
        enc = _inputs(proc, kind, seed)
        with torch.no_grad():
            seq = ref.generate(**_ref_kwargs(enc, device), max_new_tokens=new_tokens, do_sample=False)
        theirs = seq[0, enc["input_ids"].shape[1]:].tolist()
        (res,) = engine.generate([Request.from_processor(f"{variant}-{kind}", enc,
                                                         sampling=SamplingParams(max_new_tokens=new_tokens))])
        logits = _teacher_forced(ref, ref32, engine.model, enc, device, theirs)
        rows = {k: (logits[k] - logits["ref32"]).abs().amax(-1) for k in ("ours", "ref")}  # [n] per position
        err = {k: float(r.max()) for k, r in rows.items()}
        typical = {k: float(r.median()) for k, r in rows.items()}  # an MoE routing tie moves a position or two
        div = _divergence(logits, engine.model, enc, device, dtype, list(res.token_ids), theirs)
        cases.append({"variant": variant, "prompt": kind, "tokens": len(theirs), "same": div is None,
                      "first_divergence": div, "max_logit_err_vs_float32": err,
                      "median_logit_err_vs_float32": typical,
                      "logits_ok": typical["ours"] <= 2 * typical["ref"] + add})
        print(f"  {variant}/{kind}: " + ("same tokens" if div is None else f"parted at {json.dumps(div)}")
              + f" ({len(theirs)} tokens); teacher-forced |logit - transformers float32| (max over the vocabulary; "
              f"median / max over positions): ours {typical['ours']:.2e} / {err['ours']:.2e}, transformers "
              f"{typical['ref']:.2e} / {err['ref']:.2e}", flush=True)
    return cases


def main(argv=None) -> int:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--report-only", action="store_true", help="exit 0 whatever the verdict (the CPU rehearsal's "
                                                                 "bf16 run: it exercises the divergence report)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"greedy parity against transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{args.dtype} on {args.device}, {args.new_tokens} new tokens", flush=True)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            cases += run_variant(variant, Path(tmp), args.device, dtype, args.new_tokens)
    parted = [c for c in cases if not c["same"]]
    verdict = ("DIVERGED" if not all(c["logits_ok"] for c in cases) else "same tokens" if not parted
               else "parted at near-ties only" if all(c["first_divergence"]["near_tie"] for c in parted)
               else "DIVERGED")
    print(f"parity: {verdict} ({len(cases) - len(parted)} of {len(cases)} cases identical)")
    if args.json:
        Path(args.json).write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                                               "device": args.device, "dtype": args.dtype, "verdict": verdict,
                                               "cases": cases}, indent=1))
    return 1 if verdict == "DIVERGED" and not args.report_only else 0


if __name__ == "__main__":
    raise SystemExit(main())
