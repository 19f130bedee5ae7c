"""Rasterise scenes: backgrounds and filled shapes into `[H, W, 3] uint8` RGB arrays.

Backgrounds are low-saturation (greys with a slight tint) so they never read as a
shape colour: solid, a linear gradient, or smooth noise. Shapes are drawn with
PIL (no anti-aliasing, hard edges) at a centre `(cx, cy)` in pixels and a
radius `r` in pixels; squares and triangles are scaled so all kinds of one size
cover a similar area.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from vlbatch.devtools.scenes.vocab import COLOURS

BACKGROUNDS = ("solid", "gradient", "noise")


@dataclass(frozen=True)
class Background:
    """A background recipe: `kind` in BACKGROUNDS, two base RGB colours and a noise seed."""

    kind: str
    rgb_a: tuple[int, int, int]
    rgb_b: tuple[int, int, int]
    noise_seed: int


def random_background(rng: np.random.Generator) -> Background:
    """A low-saturation background: grey level 25..230 plus a tint of at most 18 levels per channel."""

    def muted() -> tuple[int, int, int]:
        grey = int(rng.integers(25, 231))
        tint = rng.integers(-18, 19, size=3)
        return tuple(int(v) for v in np.clip(grey + tint, 0, 255))

    kind = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    return Background(kind, muted(), muted(), int(rng.integers(2**31)))


def render_background(bg: Background, height: int, width: int) -> np.ndarray:
    """`[H, W, 3] uint8` pixels of a background."""
    a = np.asarray(bg.rgb_a, dtype=np.float32)
    b = np.asarray(bg.rgb_b, dtype=np.float32)
    if bg.kind == "solid":
        img = np.broadcast_to(a, (height, width, 3)).copy()
    elif bg.kind == "gradient":
        ramp = np.linspace(0.0, 1.0, width if bg.noise_seed % 2 else height, dtype=np.float32)
        ramp = ramp[None, :, None] if bg.noise_seed % 2 else ramp[:, None, None]
        img = np.broadcast_to(a + (b - a) * ramp, (height, width, 3)).copy()
    else:  # smooth noise: a coarse random grid upsampled, plus fine grain
        rng = np.random.default_rng(bg.noise_seed)
        coarse = rng.random((max(height // 24, 2), max(width // 24, 2)), dtype=np.float32)
        smooth = np.asarray(Image.fromarray((coarse * 255).astype(np.uint8)).resize((width, height), Image.BILINEAR))
        mix = (smooth.astype(np.float32) / 255.0)[:, :, None]
        img = a + (b - a) * mix + rng.normal(0.0, 6.0, (height, width, 1)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def shape_rgb(colour: str, rng: np.random.Generator) -> tuple[int, int, int]:
    """A colour's RGB with a jitter of at most 12 levels per channel."""
    base = np.asarray(COLOURS[colour], dtype=np.int64)
    return tuple(int(v) for v in np.clip(base + rng.integers(-12, 13, size=3), 0, 255))


def draw_shape(img: np.ndarray, kind: str, cx: float, cy: float, r: float, rgb: tuple[int, int, int]) -> None:
    """Fill one shape into `img` `[H, W, 3] uint8` in place."""
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=rgb)
    elif kind == "square":
        h = 0.88 * r  # half side: area ~ 3.1 r^2 like the circle
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=rgb)
    elif kind == "triangle":  # pointing up
        s = 1.2 * r
        draw.polygon([(cx, cy - s), (cx - s, cy + 0.75 * s), (cx + s, cy + 0.75 * s)], fill=rgb)
    else:
        raise ValueError(f"unknown shape kind {kind!r}")
    img[...] = np.asarray(pil)
