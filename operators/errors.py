"""Typed errors shared by every stage.

One hierarchy so that any stage can turn a failure into an error row
(`status="error"`, `error_type`, `error_message`) and the resume logic can tell
permanent failures (kept on resume) from transient ones (retried on resume).

- `VlbatchError`: base; carries `permanent` (class attribute) and a user message.
- `MediaError`: the media bytes cannot be turned into pixels (empty, truncated,
  not an image/video, audio-only, unsupported codec, decompression bomb).
- `MediaTimeoutError`: decoding exceeded the configured time limit.
- `InputError`: the request is well-formed data but violates a limit
  (aspect ratio over 200, zero fps, both fps and num_frames, over budget).
- `StorageError`: object storage failed after retries (transient).
- `EngineError`: the model stage failed for this request (transient by default).
- `ConfigError`: a job config is invalid; names the field. Raised before work starts.
"""
from __future__ import annotations


class VlbatchError(Exception):
    """Base class. `error_type` is the stable name written to the output row."""

    permanent: bool = True

    @property
    def error_type(self) -> str:
        return type(self).__name__


class MediaError(VlbatchError):
    """Bytes that are not decodable media (permanent)."""


class MediaTimeoutError(MediaError):
    """Decoding took longer than the configured limit; the decoder was killed.

    Transient: a loaded node can time out on a file that decodes fine later.
    """

    permanent = False


class InputError(VlbatchError):
    """Decodable input that violates a limit or a documented precondition (permanent)."""


class StorageError(VlbatchError):
    """Object storage failed after all retries (transient: retried on resume)."""

    permanent = False


class EngineError(VlbatchError):
    """The model stage failed for this request (transient: actor death, OOM)."""

    permanent = False


class ConfigError(VlbatchError):
    """Invalid job configuration; the message names the field."""
