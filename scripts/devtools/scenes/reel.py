"""A scene reel: several video scenes joined with hard cuts into one video, with each scene's times.

`make_reel(seeds)` re-renders the video scenes of `seeds` (`videos.make_video_scene`: the same shapes,
motion, background and duration) at one common size and frame rate, one after the other, so the
joined video has a hard cut at every scene boundary and nothing else changes between cuts but the
scene's own motion. The ground truth of each scene is its caption, its shapes and its start-end
seconds in the reel (`ReelScene`); `cuts_s` are the true cut times. What the demo's video with scenes
(`pipeline/demo.py`) runs through `video.clips.mode: scenes`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlbatch.devtools.scenes.videos import VideoScene, encode_mp4, make_video_scene, render_video


@dataclass(frozen=True)
class ReelScene:
    """One scene of a reel: the scene (its caption and shapes) and its place in the reel, seconds."""

    scene: VideoScene
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Reel:
    """frames `[T, H, W, 3] uint8` at `fps`; `scenes` in order, back to back from 0 s."""

    frames: np.ndarray
    fps: float
    scenes: tuple[ReelScene, ...]

    @property
    def cuts_s(self) -> tuple[float, ...]:
        """The true cut times: where every scene but the first starts."""
        return tuple(s.start_s for s in self.scenes[1:])

    def mp4(self) -> bytes:
        """The reel as H.264 MP4 bytes."""
        return encode_mp4(self.frames, self.fps)


def make_reel(seeds, *, width: int = 192, height: int = 144, fps: float = 8.0) -> Reel:
    """The reel of the video scenes of `seeds` at `width` x `height` (even), `fps` frames per second."""
    parts, scenes, start = [], [], 0.0
    for seed in seeds:
        scene = make_video_scene(int(seed))
        duration = scene.frames.shape[0] / scene.fps  # 2 or 3 s
        total = int(round(duration * fps))
        rng = np.random.default_rng([int(seed), 3])
        parts.append(render_video(scene.shapes, scene.background, height, width, total, rng))
        scenes.append(ReelScene(scene, start, start + total / fps))
        start += total / fps
    return Reel(np.concatenate(parts), float(fps), tuple(scenes))
