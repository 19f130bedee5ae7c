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
- `StorageError`: object storage failed after retries (transient). A source row's `error` cell is
  an `InputError` unless written by `transient_source_error` (`source_error` reads it back).
- `EngineError`: the model stage failed for this request (transient by default).
- `TruncatedError`: a structured answer hit max_tokens before its value was complete (permanent).
- `ConfigError`: a job config is invalid; names the field. Raised before work starts.
- `StorageCheckError`: a `ConfigError` for storage the start-up checks cannot reach (the field, the cause).
- `SetupError`: a `ConfigError` found while the job's own setup runs (a checkpoint without a
  chat template, a kernel the device lacks): it fails the run, never becomes an error row.

`stable_message` is the last step before a message goes into an output row: it
drops object addresses (`<_io.BytesIO object at 0x7f...>`), which differ per run.
"""
from __future__ import annotations

import re

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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


class TruncatedError(VlbatchError):
    """A structured answer (a task response format) whose generation hit max_tokens before the value was
    complete: an error row, never a half-parsed value. Permanent: the same config truncates it again."""


class StorageError(VlbatchError):
    """Object storage failed after all retries (transient: retried on resume)."""

    permanent = False


class EngineError(VlbatchError):
    """The model stage failed for this request (transient: actor death, OOM)."""

    permanent = False


class ConfigError(VlbatchError):
    """Invalid job configuration; the message names the field."""


class StorageCheckError(ConfigError):
    """The start-up checks could not reach the storage a field names (no credentials, an endpoint that
    does not answer, a refused listing): nothing started, so exit 2 as for a bad config; the message
    names the field and the cause (`pipeline/plan/preflight.py`)."""


class ActorStartError(VlbatchError):
    """No actor of a stage (`stage`: its class name, e.g. ModelStage) can start: its start failed
    with the job's own error (chained), or on every node that could hold one (pipeline/startup/placement.py)."""

    def __init__(self, stage: str, message: str, detail: str = "", config: bool = False):
        super().__init__(message)
        self.stage = stage
        self.detail = detail  # the failed actors' own tracebacks (for the run's log file, not the terminal)
        self.config = config  # the cause is a ConfigError (the job's own): a bad config's exit code

    def __reduce__(self):
        return type(self), (self.stage, str(self), self.detail, self.config)


class NodesLostError(ActorStartError):
    """Every node that could hold a stage's actor was lost mid-run and none came back within the
    grace period (`ray.node_loss_timeout_s`, pipeline/startup/node_loss.py): the run stops (exit 8)."""


class SetupError(ConfigError):
    """The job's own setup is broken (the checkpoint's files, the device), not a medium: a stage
    raises it instead of writing an error row, so the run fails and nothing is committed for it."""


def stable_message(text: str | None, limit: int = 2000) -> str | None:
    """`text` without object addresses (`<X object at 0x7f..>` -> `<X object>`), at most `limit`
    characters; None stays None. The same failure then reads the same in every run."""
    return None if text is None else _ADDRESS.sub("", text)[:limit]


# A source's `error` cell (pipeline/sources/base.py MANIFEST_SCHEMA) is a string; one written by
# `transient_source_error` starts with this mark (a control character no message of ours starts
# with: cells begin with our own words or a URI) and is read back as a StorageError.
_STORAGE_MARK = "\x1eStorageError\x1e"


def transient_source_error(message: str) -> str:
    """The `error` cell of a source row spoilt by a transient failure (a shard cut mid-stream):
    `source_error` reads it back as a `StorageError` (retried on resume)."""
    return _STORAGE_MARK + message


def source_error(cell: str) -> VlbatchError:
    """A source's `error` cell -> its error: `StorageError` when written by `transient_source_error`,
    else `InputError` (bad input, permanent)."""
    if cell.startswith(_STORAGE_MARK):
        return StorageError(cell[len(_STORAGE_MARK):])
    return InputError(cell)
