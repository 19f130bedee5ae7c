"""Inputs of the README demo (`configs/demo.yaml`), generated locally, no downloads.

`prepare_demo(out_dir)` writes under `out_dir` (default out/demo):
- `model/`: a tiny random Qwen3.5 checkpoint (`operators.checkpoints.make_tiny_checkpoint`,
  variant dense). Its answers are random tokens; the demo shows the machinery. Once the
  bundled trained model (issue 8) exists, `model.path` in demo.yaml points at it instead.
- `media/`: the sample images and videos of `operators.media.samples` (good and bad files);
- `media/manifest.jsonl`: one line per media, `{"media_uri": ..., "media_type": ...}`.
Existing outputs are kept (a second call is cheap). `demo_overrides(out_dir)` gives the
`--set` overrides for a folder other than out/demo. The demo runs as:
`run_job(load_config("configs/demo.yaml", demo_overrides(out)))` after `prepare_demo(out)`.
"""
from __future__ import annotations

import json
from pathlib import Path


def prepare_demo(out_dir: str | Path = "out/demo", *, include_bad: bool = True) -> Path:
    """Write model, media and manifest for the demo; returns the manifest path."""
    out = Path(out_dir)
    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        from operators.checkpoints import make_tiny_checkpoint

        make_tiny_checkpoint(model_dir, "dense")
    media = out / "media"
    manifest_json = media / "manifest.json"
    if not manifest_json.exists():
        from operators.media.samples import write_all

        write_all(media)
    sample = json.loads(manifest_json.read_text())
    lines = []
    for kind, key in (("image", "images"), ("video", "videos")):
        for item in sample[key]:
            if item.get("bad") and not include_bad:
                continue
            lines.append({"media_uri": str(Path(item["path"]).resolve()), "media_type": kind})
    manifest = media / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return manifest


def demo_overrides(out_dir: str | Path = "out/demo") -> list[str]:
    """`--set` overrides that point configs/demo.yaml at another demo folder."""
    out = Path(out_dir)
    return [f"model.path={out / 'model'}", f"input.uri={out / 'media' / 'manifest.jsonl'}",
            f"output.uri={out / 'output'}"]
