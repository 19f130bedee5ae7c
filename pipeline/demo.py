"""Inputs of the README demo (`configs/demo.yaml`), generated locally, no downloads.

The model is the bundled `models/shapes-tiny` (issue 8: a tiny Qwen3.5 trained on
synthetic shapes, see `vlbatch.devtools.training.shapes`). `prepare_demo(out_dir)` writes
under `out_dir` (default out/demo):
- `media/scenes/`: synthetic scenes it was trained to describe, from seeds outside both
  the training and the held-out ranges: images (PNG) and short videos (H.264 MP4);
- `media/bad/`: deliberately bad files from `vlbatch.devtools.samples` (truncated,
  zero-byte, header-lies, audio-only, ...), which must become error rows;
- `media/manifest.jsonl`: one line per media, `{"media_uri": ..., "media_type": ...}`;
- `media/truth.json`: the ground-truth caption of each scene, for the demo's printout.
Existing outputs are kept (a second call is cheap). `demo_overrides(out_dir)` gives the
`--set` overrides that point the config at `out_dir` and at the bundled model.
"""
from __future__ import annotations

import json
from pathlib import Path

from vlbatch.models import SHAPES_TINY

BUNDLED_MODEL = SHAPES_TINY
DEMO_SEED_BASE = 2_000_000_000  # training uses seeds < 1e9, the held-out set 1e9 + i
N_IMAGES, N_VIDEOS = 8, 4


def write_scenes(media: Path, n_images: int = N_IMAGES, n_videos: int = N_VIDEOS) -> dict[str, str]:
    """Scene images and videos under `media/scenes`; returns {path: ground-truth caption}."""
    from vlbatch.devtools.scenes.heldout import heldout_items

    items = heldout_items(n_images, n_videos, seed_base=DEMO_SEED_BASE)
    seen, truth = set(), {}
    for it in items:  # heldout_items asks one question per scene: keep each scene once, with its caption
        if it.id in seen:
            continue
        seen.add(it.id)
        path = it.write_media(media / "scenes")  # named by item id; renamed by scene: image-<seed>.png
        path = path.rename(path.with_name(f"{it.media_type}-{it.scene.seed}{path.suffix}"))
        truth[str(path.resolve())] = it.scene.caption
    return truth


def prepare_demo(out_dir: str | Path = "out/demo", *, include_bad: bool = True) -> Path:
    """Write scene media, bad media, manifest and truth for the demo; returns the manifest path."""
    media = Path(out_dir) / "media"
    truth_json = media / "truth.json"
    if not truth_json.exists():
        truth_json.parent.mkdir(parents=True, exist_ok=True)
        truth_json.write_text(json.dumps(write_scenes(media), indent=1))
    bad_json = media / "bad" / "manifest.json"
    if include_bad and not bad_json.exists():
        from vlbatch.devtools.samples import write_all

        write_all(media / "bad")
    lines = [{"media_uri": p, "media_type": "video" if p.endswith(".mp4") else "image"}
             for p in json.loads(truth_json.read_text())]
    if include_bad:
        sample = json.loads(bad_json.read_text())
        lines += [{"media_uri": str(Path(x["path"]).resolve()), "media_type": kind}
                  for kind, key in (("image", "images"), ("video", "videos")) for x in sample[key] if x.get("bad")]
    manifest = media / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return manifest


def demo_truth(out_dir: str | Path = "out/demo") -> dict[str, str]:
    """{media path: ground-truth caption} of the demo's scenes (empty before `prepare_demo`)."""
    path = Path(out_dir) / "media" / "truth.json"
    return json.loads(path.read_text()) if path.exists() else {}


def demo_overrides(out_dir: str | Path = "out/demo") -> list[str]:
    """`--set` overrides that point configs/demo.yaml at another demo folder and at the bundled model."""
    out = Path(out_dir)
    return [f"model.path={BUNDLED_MODEL}", f"input.uri={out / 'media' / 'manifest.jsonl'}",
            f"output.uri={out / 'output'}"]
