"""Scene items (one question about one image or video) and the held-out evaluation set.

A `SceneItem` is what a model is asked: chat `messages` with one image or video
placeholder, the media (an image `[H, W, 3]`, or a `VideoClip` of frames sampled
exactly as the reference processor samples them at 2 fps), and the ground truth
(`qa`, with its `target` attribute value, plus the whole scene).

Seeds split the data: training draws scene seeds from `[0, HELDOUT_SEED_BASE)`,
the held-out set uses `HELDOUT_SEED_BASE + i`. `heldout_items(n_images, n_videos)`
is reusable by any runner (transformers, our engine, the full pipeline):
`item.messages()` is the request, `item.image` / `item.video` / `item.video_bytes()`
the media (`item.write_media(dir)` writes it as a PNG / H.264 MP4 file), `item.qa` the truth, scored by
`score.score_answers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from vlbatch.devtools.scenes.images import QA, ImageScene, make_image_scene
from vlbatch.devtools.scenes.texts import IMAGE_TASKS, VIDEO_TASKS
from vlbatch.devtools.scenes.videos import VideoScene, encode_mp4, make_video_scene
from vlbatch.operators.media.sampling import sample_frame_indices
from vlbatch.operators.types import VideoClip

HELDOUT_SEED_BASE = 1_000_000_000
VIDEO_SAMPLE_FPS = 2.0  # the reference video processor's default sampling rate


@dataclass(frozen=True)
class SceneItem:
    """One question about one scene; exactly one of `image` / `video` is set."""

    id: str
    media_type: str  # "image" | "video"
    qa: QA
    scene: ImageScene | VideoScene
    image: np.ndarray | None = None  # [H, W, 3] uint8
    video: VideoClip | None = None  # frames [F, H, W, 3] sampled at 2 fps from the rendered clip

    def messages(self) -> list[dict]:
        """The single user turn: media placeholder then the question."""
        return [{"role": "user", "content": [{"type": self.media_type}, {"type": "text", "text": self.qa.question}]}]

    def write_media(self, directory) -> Path:
        """Write the media as a real file (`<id>.png` or `<id>.mp4`) under `directory`; returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.media_type == "video":
            path = directory / f"{self.id}.mp4"
            path.write_bytes(self.video_bytes())
        else:
            path = directory / f"{self.id}.png"
            Image.fromarray(self.image).save(path)
        return path

    def video_bytes(self) -> bytes:
        """The whole clip as an H.264 MP4 (video items only)."""
        if not isinstance(self.scene, VideoScene):
            raise TypeError(f"{self.id} is not a video item")
        return encode_mp4(self.scene.frames, self.scene.fps)


def clip_of(frames: np.ndarray, fps: float) -> VideoClip:
    """Sample `frames` `[T, H, W, 3]` at 2 fps with the reference's rule (`sample_frame_indices`)."""
    idx = sample_frame_indices(int(frames.shape[0]), fps, fps=VIDEO_SAMPLE_FPS)
    return VideoClip(frames=frames[idx], source_fps=float(fps), total_frames=int(frames.shape[0]),
                     indices=tuple(int(i) for i in idx))


def image_item(seed: int, task: str, rng: np.random.Generator) -> SceneItem:
    """A question of `task` about image scene `seed` (one of its QAs of that task, drawn by `rng`)."""
    scene = make_image_scene(seed)
    qa = _pick(scene.qas, task, rng)
    return SceneItem(f"image-{seed}-{qa.task}", "image", qa, scene, image=scene.image)


def video_item(seed: int, task: str, rng: np.random.Generator) -> SceneItem:
    """A question of `task` about video scene `seed`."""
    scene = make_video_scene(seed)
    qa = _pick(scene.qas, task, rng)
    return SceneItem(f"video-{seed}-{qa.task}", "video", qa, scene, video=clip_of(scene.frames, scene.fps))


def _pick(qas, task: str, rng: np.random.Generator) -> QA:
    options = [q for q in qas if q.task == task]
    if task == "motion" and rng.random() < 0.75:  # mostly ask about the active (moving / changing) shape
        options = options[:1]
    if not options:  # every scene has caption/count/shape/position/motion/colour_* ; "colour" may be absent
        options = [q for q in qas if q.task == "shape"]
    return options[int(rng.integers(len(options)))]


def heldout_items(n_images: int = 60, n_videos: int = 40, *, seed_base: int = HELDOUT_SEED_BASE) -> list[SceneItem]:
    """The held-out set: image scenes cycle through IMAGE_TASKS, videos through VIDEO_TASKS.

    Deterministic; seeds `seed_base + i` never occur in training.
    """
    rng = np.random.default_rng(seed_base)
    items = [image_item(seed_base + i, IMAGE_TASKS[i % len(IMAGE_TASKS)], rng) for i in range(n_images)]
    items += [
        video_item(seed_base + n_images + i, VIDEO_TASKS[i % len(VIDEO_TASKS)], rng) for i in range(n_videos)
    ]
    return items
