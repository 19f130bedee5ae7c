"""CPU preprocessing identical to the reference processor (Ray-free).

Owns: smart_resize and the resize op (`resize`), rescale/normalise/patchify
(`patchify`), decoded-media validation and pixel output (`visual`), MRoPE position
ids (`rope`), prompt rendering and placeholder expansion (`prompt`), processor
settings (`config`) and the `Processor` that ties them together (`processor`).

Image loading and frame sampling belong to the media side (`vlbatch.operators.media.image`,
`vlbatch.operators.media.sampling`: data flows media -> preprocess); `load_image`,
`sample_frame_indices` and `group_timestamps` stay importable from here.
`sample_frame_indices` / `group_timestamps` import only numpy; the rest (torch,
Pillow, transformers) loads on first attribute access.
"""
from __future__ import annotations

from vlbatch.operators.media.sampling import group_timestamps, sample_frame_indices

__all__ = ["sample_frame_indices", "group_timestamps", "load_image", "Processor"]


def __getattr__(name: str):
    if name == "load_image":
        from vlbatch.operators.media.image import load_image

        return load_image
    if name == "Processor":
        from vlbatch.operators.preprocess.processor import Processor

        return Processor
    raise AttributeError(f"module 'vlbatch.operators.preprocess' has no attribute {name!r}")
