"""Short video scenes: one active shape that moves or changes colour, maybe a still second shape.

`make_video_scene(seed)` is a pure function of the seed. Clips last 2 or 3 s at 4-8
frames per second, with frames `[T, H, W, 3] uint8`. The active shape (listed
first) either moves in one of four directions (travelling `SPEED_TRAVEL` of the
frame over the clip) or changes colour at the clip's midpoint; an optional second
shape of another kind stays still, in the other half of the frame. Kinds are
unique within a video, so "the square" always names one shape.
`encode_mp4` writes real H.264 files for pipelines that read encoded media.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from vlbatch.devtools.scenes import texts
from vlbatch.devtools.scenes.draw import (
    Background,
    draw_shape,
    random_background,
    render_background,
    shape_rgb,
)
from vlbatch.devtools.scenes.vocab import (
    COLOURS,
    DIRECTION_VECTORS,
    DIRECTIONS,
    KINDS,
    SPEED_TRAVEL,
    SPEEDS,
    STILL,
)

FPS_CHOICES = (4, 5, 6, 8)
DURATIONS_S = (2, 3)
RADIUS = (0.13, 0.17)  # fraction of min(H, W)


@dataclass(frozen=True)
class VideoShape:
    """A shape over a clip: start centre (fractions), `motion` in DIRECTIONS or "still", colours at start / end."""

    kind: str
    colour_start: str
    colour_end: str
    motion: str
    speed: str | None
    cx: float
    cy: float


@dataclass(frozen=True)
class VideoScene:
    """Frames `[T, H, W, 3] uint8` at `fps`, shapes (active first), caption and questions."""

    seed: int
    frames: np.ndarray
    fps: float
    background: Background
    shapes: tuple[VideoShape, ...]
    caption: str
    qas: tuple


def _active_shape(rng: np.random.Generator, kind: str, band: float) -> VideoShape:
    colours = list(COLOURS)
    c0 = colours[int(rng.integers(len(colours)))]
    if rng.random() < 0.3:  # colour change, no motion
        c1 = [c for c in colours if c != c0][int(rng.integers(len(colours) - 1))]
        return VideoShape(kind, c0, c1, STILL, None, float(rng.uniform(0.3, 0.7)), band)
    direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    speed = SPEEDS[int(rng.integers(len(SPEEDS)))]
    dx, dy = DIRECTION_VECTORS[direction]
    start_along = 0.5 - SPEED_TRAVEL[speed] / 2 + float(rng.uniform(-0.05, 0.05))
    # along the motion axis start on the far side; across it sit in the shape's band
    cx = start_along if dx > 0 else 1 - start_along if dx < 0 else band
    cy = start_along if dy > 0 else 1 - start_along if dy < 0 else band
    return VideoShape(kind, c0, c0, direction, speed, float(cx), float(cy))


def _centre_at(shape: VideoShape, frac: float) -> tuple[float, float]:
    """Centre (fractions) at `frac` in [0, 1] of the clip."""
    if shape.motion == STILL:
        return shape.cx, shape.cy
    dx, dy = DIRECTION_VECTORS[shape.motion]
    travel = SPEED_TRAVEL[shape.speed]
    return shape.cx + dx * travel * frac, shape.cy + dy * travel * frac


def render_video(
    shapes, background: Background, height: int, width: int, total: int, rng: np.random.Generator
) -> np.ndarray:
    """`[T, H, W, 3] uint8` frames; a colour change happens at frame `total // 2`."""
    base = render_background(background, height, width)
    side = min(height, width)
    radii = [side * rng.uniform(*RADIUS) for _ in shapes]
    rgbs = [(shape_rgb(s.colour_start, rng), shape_rgb(s.colour_end, rng)) for s in shapes]
    frames = np.empty((total, height, width, 3), dtype=np.uint8)
    for t in range(total):
        frame = base.copy()
        frac = t / max(total - 1, 1)
        for s, r, (rgb0, rgb1) in zip(shapes, radii, rgbs, strict=True):
            cx, cy = _centre_at(s, frac)
            draw_shape(frame, s.kind, cx * width, cy * height, r, rgb1 if t >= total // 2 else rgb0)
        frames[t] = frame
    return frames


def make_video_scene(seed: int) -> VideoScene:
    """The video scene of `seed`."""
    rng = np.random.default_rng([seed, 2])
    width = int(rng.integers(8, 17)) * 16
    height = int(rng.integers(6, 13)) * 16
    fps = float(FPS_CHOICES[int(rng.integers(len(FPS_CHOICES)))])
    total = int(fps * DURATIONS_S[int(rng.integers(len(DURATIONS_S)))])
    kinds = [str(k) for k in rng.permutation(KINDS)]
    bands = (0.27, 0.73) if rng.random() < 0.5 else (0.73, 0.27)
    shapes = [_active_shape(rng, kinds[0], bands[0] + float(rng.uniform(-0.04, 0.04)))]
    if rng.random() < 0.5:  # a still second shape in the other band
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        along = float(rng.uniform(0.25, 0.75))
        horizontal = shapes[0].motion in ("left", "right") or shapes[0].motion == STILL
        cx, cy = (along, bands[1]) if horizontal else (bands[1], along)
        shapes.append(VideoShape(kinds[1], colour, colour, STILL, None, cx, cy))
    background = random_background(rng)
    frames = render_video(shapes, background, height, width, total, rng)
    caption = texts.video_caption(shapes)
    return VideoScene(seed, frames, fps, background, tuple(shapes), caption, tuple(texts.video_qas(shapes, caption)))


def encode_mp4(frames: np.ndarray, fps: float, *, crf: int = 18) -> bytes:
    """H.264 (yuv420p) MP4 bytes of `frames` `[T, H, W, 3] uint8` (H and W even)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decode_mp4(data: bytes) -> np.ndarray:
    """All frames `[T, H, W, 3] uint8` of MP4 bytes (PyAV), for checks and tests."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
