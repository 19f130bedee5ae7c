"""Still-image scenes: one to three shapes on a background, with a caption and questions.

`make_image_scene(seed)` is a pure function of the seed. Shapes sit in distinct
cells of a 3 x 3 grid (a shape's `position` is the cell of its centre, kept in
the middle of the cell so the label is never borderline) and never overlap.
The caption lists shapes in reading order (`POSITIONS` order):
"Two shapes: a large red circle at the top left and a small blue square in the center."
"""
from __future__ import annotations

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
from vlbatch.devtools.scenes.texts import QA  # noqa: F401 - re-exported (scenes.images.QA)
from vlbatch.devtools.scenes.vocab import COLOURS, KINDS, MAX_SHAPES, POSITIONS, SIZES

# radius as a fraction of min(H, W)
SIZE_RADIUS = {"small": (0.07, 0.085), "large": (0.12, 0.14)}


@dataclass(frozen=True)
class Shape:
    """One shape of a scene; `cx`, `cy` are its centre as fractions of width / height."""

    kind: str
    colour: str
    size: str
    position: str
    cx: float
    cy: float


@dataclass(frozen=True)
class ImageScene:
    """A rendered image `[H, W, 3] uint8` with its shapes (reading order), caption and questions."""

    seed: int
    image: np.ndarray
    background: Background
    shapes: tuple[Shape, ...]
    caption: str
    qas: tuple[QA, ...]


def random_shapes(rng: np.random.Generator, count: int) -> list[Shape]:
    """`count` shapes in distinct grid cells, in reading order."""
    cells = sorted(int(c) for c in rng.choice(len(POSITIONS), size=count, replace=False))
    colours = list(COLOURS)
    shapes = []
    for cell in cells:
        row, col = divmod(cell, 3)
        cx = (col + 0.5 + rng.uniform(-0.09, 0.09)) / 3
        cy = (row + 0.5 + rng.uniform(-0.09, 0.09)) / 3
        shapes.append(
            Shape(
                kind=KINDS[int(rng.integers(len(KINDS)))],
                colour=colours[int(rng.integers(len(colours)))],
                size=SIZES[int(rng.integers(len(SIZES)))],
                position=POSITIONS[cell],
                cx=float(cx),
                cy=float(cy),
            )
        )
    return shapes


def render_shapes(
    img: np.ndarray, shapes, rng: np.random.Generator, radii: list[float] | None = None, rgbs=None
) -> tuple[list[float], list]:
    """Draw `shapes` into `img` `[H, W, 3]`; returns the radii (pixels) and RGBs used (drawn if not given)."""
    h, w = img.shape[:2]
    side = min(h, w)
    radii = radii or [side * rng.uniform(*SIZE_RADIUS[s.size]) for s in shapes]
    rgbs = rgbs or [shape_rgb(s.colour, rng) for s in shapes]
    for s, r, rgb in zip(shapes, radii, rgbs, strict=True):
        draw_shape(img, s.kind, s.cx * w, s.cy * h, r, rgb)
    return radii, rgbs


def make_image_scene(seed: int, *, size_range: tuple[int, int] = (160, 416)) -> ImageScene:
    """The image scene of `seed`: random size in `size_range` (per side, aspect at most 2:1)."""
    rng = np.random.default_rng([seed, 1])
    lo, hi = size_range
    width = int(rng.integers(lo, hi + 1))
    height = int(np.clip(rng.integers(lo, hi + 1), width // 2, width * 2))
    background = random_background(rng)
    image = render_background(background, height, width)
    shapes = random_shapes(rng, int(rng.integers(1, MAX_SHAPES + 1)))
    render_shapes(image, shapes, rng)
    caption = texts.image_caption(shapes)
    return ImageScene(seed, image, background, tuple(shapes), caption, tuple(texts.image_qas(shapes, caption)))
