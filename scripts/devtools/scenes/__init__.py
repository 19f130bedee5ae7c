"""Synthetic scenes with ground truth: shapes in images and short videos, captions, questions, scoring.

Owns the data the bundled demo model (`models/shapes-tiny`) is trained on and
evaluated with: `make_image_scene(seed)` / `make_video_scene(seed)` (pure
functions of the seed), the held-out set builder (`heldout.py`, seeds disjoint
from training) and the scorer (`score.py`).
"""
from vlbatch.devtools.scenes.images import QA, ImageScene, Shape, make_image_scene
from vlbatch.devtools.scenes.videos import VideoScene, VideoShape, decode_mp4, encode_mp4, make_video_scene

__all__ = [
    "QA",
    "ImageScene",
    "Shape",
    "VideoScene",
    "VideoShape",
    "decode_mp4",
    "encode_mp4",
    "make_image_scene",
    "make_video_scene",
]
