"""The closed vocabulary of synthetic scenes: colours, shape kinds, sizes, positions, motions.

Everything a scene can contain and every word its captions and answers use is
named here, so the generator, the answer texts and the scorer agree by
construction. Colours are saturated and far apart in hue; backgrounds are
low-saturation, so no background can be mistaken for a shape colour.
"""
from __future__ import annotations

# name -> RGB (shapes jitter each channel by a few levels around these)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 175, 45),
    "blue": (35, 70, 225),
    "yellow": (240, 215, 25),
    "purple": (145, 45, 185),
    "orange": (245, 135, 20),
}
KINDS = ("circle", "square", "triangle")
SIZES = ("small", "large")

# 3 x 3 grid cells, row-major (reading order); the name of the cell holding a shape's centre
POSITIONS = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
# "<position phrase>" as used in captions and answers, e.g. "at the top left", "in the center"
POSITION_PHRASES = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}

DIRECTIONS = ("left", "right", "up", "down")
# unit motion per direction in image coordinates (x right, y down)
DIRECTION_VECTORS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
SPEEDS = ("slowly", "quickly")
# fraction of the frame's extent travelled over the whole clip
SPEED_TRAVEL = {"slowly": 0.35, "quickly": 0.6}
STILL = "still"  # the motion answer of a shape that does not move

NUMBER_WORDS = {1: "one", 2: "two", 3: "three"}
MAX_SHAPES = 3
