"""Train the bundled demo model: a tiny Qwen3.5 that captions and answers about synthetic shapes.

    python -m vlbatch.devtools.training.shapes --out DIR [--vision-steps N] [--steps M] [--init DIR] ...

Reference implementation throughout: transformers' `Qwen3_5ForConditionalGeneration`
(built by `vlbatch.devtools.checkpoints.tiny.build_reference_model` with the sizes below, norms
reset to their trained-from-scratch init) and transformers' processor for inputs. Every
step draws fresh scenes (seeds below the held-out range), so there is no epoch.
Two stages, AdamW with linear warm-up and cosine decay in each:
1. `--vision-steps`: the vision tower alone on the auxiliary per-token loss (`vision_aux`);
2. `--steps`: everything, on answer tokens (`batches.collate` labels) plus the auxiliary
   loss at `--aux-weight`, which keeps the tower informative (without it the tower
   collapses or stays random and the decoder answers from the prior).
`--stop-after N` ends stage 2 early with the schedule of `--steps`; `--init` / `--init-vision`
continue from a saved checkpoint. scripts/devtools/training/README.md has the chain of
runs that produced models/shapes-tiny. Deterministic for a seed and thread count.
The processor budgets are smaller than the 9B's so visual tokens stay few:
images at most 36 merged tokens, videos at most 48 over all frames.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from vlbatch.devtools.checkpoints import tiny
from vlbatch.devtools.checkpoints import tokenizer as tok
from vlbatch.devtools.scenes.heldout import HELDOUT_SEED_BASE

VISION = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "depth": 2}
# [linear, full] x2 (full_attention_interval 2, not the 9B's 4): two Gated DeltaNet and two gated
# full-attention layers; questions like "what colour is the circle?" need one attention hop to find
# the question's subject and one to read the matching visual token
TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2}
IMAGE_SIZE = {"shortest_edge": 16384, "longest_edge": 36864}  # 16..36 merged tokens (e.g. 192 x 192 pixels)
VIDEO_SIZE = {"shortest_edge": 16384, "longest_edge": 98304}  # at most 48 merged tokens per clip


def write_processor_files(out: Path) -> None:
    """Tokenizer, chat template and processor configs with the demo model's small budgets."""
    tiny.write_tokenizer_and_processor(out)
    image = dict(tiny.IMAGE_PROCESSOR, size=IMAGE_SIZE)
    video = dict(tiny.VIDEO_PROCESSOR, size=VIDEO_SIZE)
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


def save_checkpoint(model, out: Path, dtype: str) -> None:
    """Hugging Face layout: config.json, model.safetensors, generation config, tokenizer, processor files."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    to_save = copy.deepcopy(model).to(getattr(torch, dtype))
    to_save.save_pretrained(out, safe_serialization=True)
    ids = tok.special_token_ids()
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_processor_files(out)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, cosine decay to 5% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(total - warmup, 1)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


class SceneBatches(torch.utils.data.IterableDataset):
    """An endless iterable of collated training batches with vision targets, drawn from `seed`.

    Runs in one DataLoader worker. Each batch is the processor's inputs plus `labels` and
    `vision_targets [N, 3]` (see `token_labels`).
    """

    def __init__(self, processor_dir: str, seed: int, batch: int, video_share: float, image_weights=None):
        super().__init__()
        self.processor_dir, self.seed, self.batch, self.video_share = processor_dir, seed, batch, video_share
        self.image_weights = image_weights

    def __iter__(self):
        from transformers import AutoProcessor

        from vlbatch.devtools.training.batches import collate, sample_items, vision_targets

        torch.set_num_threads(1)
        processor = AutoProcessor.from_pretrained(self.processor_dir)
        rng = np.random.default_rng(self.seed)
        while True:
            items = sample_items(rng, self.batch, self.video_share, HELDOUT_SEED_BASE, self.image_weights)
            batch = collate(processor, items)
            batch["vision_targets"] = vision_targets(batch, items)
            yield batch


def _batches(out: Path, seed: int, batch: int, video_share: float, image_weights=None):
    return iter(torch.utils.data.DataLoader(
        SceneBatches(str(out), seed, batch, video_share, image_weights), batch_size=None, num_workers=1,
        prefetch_factor=4,
        persistent_workers=False,
    ))


def train(args) -> Path:
    """Two stages: the vision tower alone on the auxiliary loss, then everything on answers + auxiliary loss."""
    from vlbatch.devtools.training.fast_patch import use_linear_patch_embed
    from vlbatch.devtools.training.vision_aux import VisionAux

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    write_processor_files(out)
    model = _initial_model(args)
    use_linear_patch_embed(model)  # same weights, faster backward (see fast_patch.py)
    model.train()
    aux = VisionAux(model)
    print(f"params {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M", flush=True)
    start = time.time()
    # stage 1: the vision tower learns colour / kind / size per token (cheap: no decoder)
    vision_params = list(model.model.visual.parameters()) + list(aux.parameters())
    opt = torch.optim.AdamW(vision_params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    batches = _batches(out, args.seed + 1, args.vision_batch, args.vision_video_share)
    for step in range(args.vision_steps):
        batch = next(batches)
        _set_lr(opt, lr_at(step, args.vision_steps, args.lr, args.warmup))
        aux.encode(model, batch)
        loss = aux.loss(batch["vision_targets"])
        _step(opt, loss, vision_params)
        if step % args.log_every == 0 or step == args.vision_steps - 1:
            aux.encode(model, batch)
            print(f"vision step {step} aux {loss.item():.4f} acc {_fmt(aux.accuracy(batch['vision_targets']))}"
                  f" elapsed {time.time() - start:.0f}s", flush=True)
    del batches
    _train_all(args, model, aux, out, start)
    aux.remove()
    model.eval()
    save_checkpoint(model, out, args.dtype)
    print(f"saved {out} after {time.time() - start:.0f}s", flush=True)
    return out


def _initial_model(args):
    """The reference model at the run's sizes: fresh (seeded), or continued from `--init` (a saved
    checkpoint of exactly these sizes), or with `--init-vision`'s vision tower (same vision sizes)."""
    from transformers import AutoModelForImageTextToText

    vision = dict(VISION, hidden_size=args.vision_width, intermediate_size=2 * args.vision_width,
                  depth=args.vision_depth)
    model = tiny.build_reference_model("dense", seed=args.seed, init_std=args.init_std, vision_overrides=vision, **TEXT)
    _reset_norms(model)
    if args.init:
        model.load_state_dict(AutoModelForImageTextToText.from_pretrained(args.init, dtype=torch.float32).state_dict())
    elif args.init_vision:  # the vision tower of an earlier run (e.g. one with --steps 0)
        saved = AutoModelForImageTextToText.from_pretrained(args.init_vision, dtype=torch.float32)
        model.model.visual.load_state_dict(saved.model.visual.state_dict())
    return model


def _train_all(args, model, aux, out: Path, start: float) -> None:
    """Stage 2: everything, on answer tokens plus the auxiliary loss (keeps the tower from collapsing)."""
    params = list(model.parameters()) + list(aux.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    batches = _batches(out, args.seed, args.batch, args.video_share, _weights(args.image_weights))
    last = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
    ema = None
    for step in range(last):
        batch = next(batches)
        targets = batch.pop("vision_targets")
        _set_lr(opt, lr_at(step, args.steps, args.lr, args.warmup))
        lm = model(**batch).loss
        vis = aux.loss(targets)
        _step(opt, lm + args.aux_weight * vis, params)
        ema = lm.item() if ema is None else 0.95 * ema + 0.05 * lm.item()
        if step % args.log_every == 0 or step == last - 1:
            print(f"step {step} loss {lm.item():.4f} ema {ema:.4f} aux {vis.item():.4f}"
                  f" lr {lr_at(step, args.steps, args.lr, args.warmup):.2e} elapsed {time.time() - start:.0f}s",
                  flush=True)
        if args.save_every and step and step % args.save_every == 0:
            save_checkpoint(model, out, args.dtype)


def _reset_norms(model) -> None:
    """Undo `build_reference_model`'s randomised norm weights (a parity-test device, not a training init)."""
    with torch.no_grad():
        for module in model.modules():
            kind = type(module).__name__
            if kind.endswith("RMSNormGated") or isinstance(module, torch.nn.LayerNorm):
                module.weight.fill_(1.0)  # plain scale
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif kind.endswith("RMSNorm"):
                module.weight.zero_()  # zero-centred: scale 1 + w


def _weights(spec: str | None) -> dict[str, float] | None:
    """"caption=0.2,count=0.05,..." -> {task: weight} (every image task must be named)."""
    if not spec:
        return None
    from vlbatch.devtools.scenes.texts import IMAGE_TASKS

    weights = {k: float(v) for k, v in (part.split("=") for part in spec.split(","))}
    if set(weights) != set(IMAGE_TASKS):
        raise SystemExit(f"--image-weights must name exactly {', '.join(IMAGE_TASKS)}")
    return weights


def _set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def _step(opt, loss, params) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def _fmt(acc: dict) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in acc.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Train the bundled tiny Qwen3.5 on synthetic scenes (CPU).")
    ap.add_argument("--out", default="models/shapes-tiny")
    ap.add_argument("--steps", type=int, default=1400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--video-share", type=float, default=0.45)
    ap.add_argument("--image-weights", default=None,
                    help="stage-2 image task mix, e.g. caption=0.2,count=0.05,colour=0.3,shape=0.15,position=0.3")
    ap.add_argument("--vision-steps", type=int, default=300, help="vision-only steps on the auxiliary loss")
    ap.add_argument("--vision-batch", type=int, default=32)
    ap.add_argument("--vision-width", type=int, default=VISION["hidden_size"])
    ap.add_argument("--vision-depth", type=int, default=VISION["depth"])
    ap.add_argument("--vision-video-share", type=float, default=0.2, help="kinds and sizes are labelled on images only")
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the auxiliary vision loss in stage 2")
    # ~1/sqrt(hidden): with GPT-style 0.02 at width 128 every linear map shrinks signals ~4x and the
    # decoder took ~2x longer to start reading visual tokens in an overfit probe
    ap.add_argument("--init-std", type=float, default=0.08)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None, help="start from this checkpoint (same sizes)")
    ap.add_argument("--init-vision", default=None, help="start the vision tower from this checkpoint's")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="end (and save) after this many steps, keeping the schedule of --steps")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=500)
    train(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
