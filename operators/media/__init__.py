"""Media I/O: bytes to pixels; video decoding in a killable process.

Bytes come from `vlbatch.operators.storage` (`read_bytes`: local / s3:// with retries).
Owns `image` (`load_image`: bytes -> upright RGB), `sampling` (`sample_frame_indices`,
`group_timestamps`: which frames, and their seconds), `decoders` (PyAV, TorchCodec, decord
behind `VideoDecoder`), `video` (probe -> sample -> decode plan), `worker` (the time-limited
child process, parent side), `child` (its loop), `wire` (its message format), `ring` (the
shared-memory frame hand-off), `load` (`load_media` for images and videos).
Nothing here imports `vlbatch.operators.preprocess` (data flows media -> preprocess).
Submodules are imported
lazily by callers; importing this package loads nothing heavy.
"""
from __future__ import annotations

__all__ = ["FrameSampling", "DecodeWorker", "decode_video", "load_media"]


def __getattr__(name: str):
    if name == "FrameSampling":
        from vlbatch.operators.media.video import FrameSampling

        return FrameSampling
    if name in ("DecodeWorker", "decode_video"):
        from vlbatch.operators.media import worker

        return getattr(worker, name)
    if name == "load_media":
        from vlbatch.operators.media.load import load_media

        return load_media
    raise AttributeError(name)
