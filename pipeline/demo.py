"""Inputs of the README demo (`configs/demo.yaml`), generated locally, no downloads.

The model is the bundled `models/shapes-tiny` (issue 8: a tiny Qwen3.5 trained on
synthetic shapes, see `vlbatch.devtools.training.shapes`). `prepare_demo(out_dir)` writes
under `out_dir` (default out/demo):
- `media/scenes/`: synthetic scenes it was trained to describe, from seeds outside both
  the training and the held-out ranges: images (PNG) and short videos (H.264 MP4), and one
  reel: video scenes joined with hard cuts (`vlbatch.devtools.scenes.reel`, issue 51), which
  the demo's `video.clips.mode: scenes` cuts into clips;
- `media/bad/`: deliberately bad files from `vlbatch.devtools.samples` (truncated,
  zero-byte, header-lies, audio-only, ...), which must become error rows;
- `media/manifest.jsonl`: one line per media, `{"media_uri": ..., "media_type": ...}`;
- `media/scenes.json`: the scene generator's own record of each media, for the demo's printout:
  `{path: {"caption", "shapes": [kind, ...]}}`, and for the reel `{path: {"fps", "scenes": [{"start_s",
  "end_s", "caption", "shapes"}, ...]}}` (shapes: the kinds, in the scene's order).
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
REEL_SEEDS = tuple(DEMO_SEED_BASE + 100 + i for i in range(4))  # 4 scenes of 2-3 s: a 10 s video, 3 cuts
RECORD = "scenes.json"


def write_scenes(media: Path, n_images: int = N_IMAGES, n_videos: int = N_VIDEOS) -> dict[str, dict]:
    """Scene images and videos under `media/scenes`; returns {path: {"caption", "shapes"}}."""
    from vlbatch.devtools.scenes.heldout import heldout_items

    items = heldout_items(n_images, n_videos, seed_base=DEMO_SEED_BASE)
    seen, truth = set(), {}
    for it in items:  # heldout_items asks one question per scene: keep each scene once, with its caption
        if it.id in seen:
            continue
        seen.add(it.id)
        path = it.write_media(media / "scenes")  # named by item id; renamed by scene: image-<seed>.png
        path = path.rename(path.with_name(f"{it.media_type}-{it.scene.seed}{path.suffix}"))
        truth[str(path.resolve())] = {"caption": it.scene.caption, "shapes": [s.kind for s in it.scene.shapes]}
    return truth


def write_reel(media: Path, seeds=REEL_SEEDS) -> dict[str, dict]:
    """The reel of `seeds` as `media/scenes/reel.mp4`; returns {path: {"scenes": [...]}} (module docstring)."""
    from vlbatch.devtools.scenes.reel import make_reel

    reel = make_reel(seeds)
    path = media / "scenes" / "reel.mp4"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(reel.mp4())
    scenes = [{"start_s": s.start_s, "end_s": s.end_s, "caption": s.scene.caption,
               "shapes": [x.kind for x in s.scene.shapes]} for s in reel.scenes]
    return {str(path.resolve()): {"fps": reel.fps, "scenes": scenes}}


def prepare_demo(out_dir: str | Path = "out/demo", *, include_bad: bool = True) -> Path:
    """Write scene media, bad media, manifest and truth for the demo; returns the manifest path."""
    media = Path(out_dir) / "media"
    record = media / RECORD
    if not record.exists():
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({**write_scenes(media), **write_reel(media)}, indent=1))
    bad_json = media / "bad" / "manifest.json"
    if include_bad and not bad_json.exists():
        from vlbatch.devtools.samples import write_all

        write_all(media / "bad")
    lines = [{"media_uri": p, "media_type": "video" if p.endswith(".mp4") else "image"}
             for p in json.loads(record.read_text())]
    if include_bad:
        sample = json.loads(bad_json.read_text())
        lines += [{"media_uri": str(Path(x["path"]).resolve()), "media_type": kind}
                  for kind, key in (("image", "images"), ("video", "videos")) for x in sample[key] if x.get("bad")]
    manifest = media / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return manifest


def demo_truth(out_dir: str | Path = "out/demo") -> dict[str, dict]:
    """The scene generator's record of the demo's media (module docstring; empty before `prepare_demo`)."""
    path = Path(out_dir) / "media" / RECORD
    return json.loads(path.read_text()) if path.exists() else {}


def demo_overrides(out_dir: str | Path = "out/demo") -> list[str]:
    """`--set` overrides that point configs/demo.yaml at another demo folder and at the bundled model."""
    out = Path(out_dir)
    return [f"model.path={BUNDLED_MODEL}", f"input.uri={out / 'media' / 'manifest.jsonl'}",
            f"output.uri={out / 'output'}"]
