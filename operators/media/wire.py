"""The decoder child's wire format: JSON headers and raw bytes, never pickle.

The child (`vlbatch.operators.media.worker`) parses untrusted media, so the parent
treats everything it sends as hostile input: nothing is unpickled, every header is
checked (types, shape, dtype, size against the caller's limits) before the parent
allocates anything, and anything unexpected is a `MediaError`.

Both channels carry messages: an 8-byte big-endian length, then that many bytes. The request channel
is a unix socket (`vlbatch.operators.media.channel`): each request's first bytes carry one descriptor
(SCM_RIGHTS), the video's file; the video's bytes never cross either channel.

    parent -> child: {"backend", "threads", "sampling": {FrameSampling fields}, "size": the file's checked byte
      count (the child reads no further), "plan_only", "clips": {ClipRule fields} | null, "clip_files":
      {ClipFiles fields} | null} (JSON) with the file's descriptor attached; during a decode, one credit
      byte per free ring slot (`vlbatch.operators.media.ring`)
    child -> parent, one JSON object per message (at most MAX_HEADER_BYTES):
      {"kind": "ready"}
      {"kind": "plan", "dtype": "uint8", "shape": [F, H, W, 3], "source_fps", "total_frames", "indices": [F]}
      {"kind": "frame", "slot": i, "dtype": "uint8", "shape": [H, W, 3]}  its H * W * 3 bytes are in ring slot
        n % slots (n: the frames of this plan before it; the parent's own count), never on the pipe
      {"kind": "clip", "index", "start", "end", "fps", "source"} (a `clips.Clip`) + the "plan" fields: one clip of
        a "clips" request, its F frames follow as for a plan; or + "error": {"type", "message"} (that clip's
        own error), no frames; with "clip_files", + "file": the clip file's name in the parent's folder (the
        parent stores it), or "file_error": message (the codec refused), or "file_failed": message (the local
        write failed), or none of these (a clip the parent said to skip)
      {"kind": "done"}
      {"kind": "error", "type": one of CHILD_ERRORS' names, "message": str}

Frames of one plan arrive in slot order 0..F-1; a second plan restarts them (the
PyAV recount); "done" is accepted only after all F frames. `plan_only` requests (the deferred
decode's `DecodeWorker.plan`) get a plan and "done", no frames and no credits. "clips" requests
(`DecodeWorker.decode_clips`) get clips in index order 0, 1, ... (each restarts the slots, as a second
plan does), then "done", or an "error" for the rest of the video.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import ConfigError, InputError, MediaError, VlbatchError
from vlbatch.operators.media.clip_files import ClipFileSettings
from vlbatch.operators.media.clips import Clip, ClipRule
from vlbatch.operators.media.video import FrameSampling, Plan

LENGTH = struct.Struct("!Q")  # the length prefix of every message
MAX_HEADER_BYTES = 16 << 20  # a plan of 768 indices is ~6 KB; anything near this is hostile
CHILD_ERRORS = (MediaError, InputError, ConfigError)  # what an honest child reports; anything else -> MediaError


def _plain(value):
    if isinstance(value, np.generic):  # numpy scalars in a FrameSampling: their Python value
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def message(payload: bytes) -> bytes:
    """One message: length prefix + payload."""
    return LENGTH.pack(len(payload)) + payload


def encode(header: dict) -> bytes:
    """A JSON header as one message."""
    return message(json.dumps(header, separators=(",", ":"), default=_plain).encode())


def header_length(prefix: bytes) -> int:
    """The length a child's message claims; refused (`MediaError`) above MAX_HEADER_BYTES, before any allocation."""
    (n,) = LENGTH.unpack(prefix)
    if n > MAX_HEADER_BYTES:
        raise MediaError(f"the decoder sent a {n}-byte header (limit {MAX_HEADER_BYTES}); refused")
    return n


def parse_header(raw: bytes) -> dict:
    """A child's header: a JSON object with a string "kind"; `MediaError` otherwise."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, nesting bombs
        raise MediaError(f"the decoder sent a malformed header: {str(e)[:200]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise MediaError("the decoder sent a header that is not an object with a kind")
    return header


def _ints(value, name: str, length: int | None = None) -> tuple[int, ...]:
    """Validate a JSON list of non-negative ints (bools are not ints here)."""
    if not isinstance(value, list) or (length is not None and len(value) != length) or \
            not all(type(v) is int and v >= 0 for v in value):
        raise MediaError(f"the decoder sent a bad {name}: {str(value)[:200]}")
    return tuple(value)


@dataclass(frozen=True)
class ClipHeader:
    """A validated "plan" header: the output's shape `(F, H, W, 3)` and the `VideoClip` metadata."""

    shape: tuple[int, int, int, int]
    source_fps: float
    total_frames: int
    indices: tuple[int, ...]


def parse_plan(header: dict, max_bytes: int) -> ClipHeader:
    """Check a "plan" header; `MediaError` if malformed or if its frames would exceed `max_bytes`."""
    shape = _ints(header.get("shape"), "frame shape", 4)
    if header.get("dtype") != "uint8" or shape[3] != 3:
        raise MediaError(f"the decoder sent frames of {header.get('dtype')!r} {shape}, not uint8 RGB")
    nbytes = math.prod(shape)  # Python ints: no overflow
    if nbytes > max_bytes:
        raise MediaError(f"the decoder claimed {nbytes} bytes of frames, over the {max_bytes}-byte limit; refused")
    fps, total = header.get("source_fps"), header.get("total_frames")
    if type(fps) not in (int, float) or type(total) is not int or total < 0:
        raise MediaError(f"the decoder sent bad metadata: fps {fps!r}, frames {total!r}")
    return ClipHeader(shape, fps, total, _ints(header.get("indices"), "index list", shape[0]))


def check_frame(header: dict, slot: int, row_shape: tuple[int, ...]) -> None:
    """Check a "frame" header: the expected `slot`, uint8 and exactly `row_shape` `(H, W, 3)`."""
    if header.get("slot") != slot or type(header.get("slot")) is not int:
        raise MediaError(f"the decoder sent frame {str(header.get('slot'))[:50]}, expected frame {slot}")
    if header.get("dtype") != "uint8" or _ints(header.get("shape"), "frame shape", 3) != row_shape:
        raise MediaError(f"the decoder sent a frame of {header.get('dtype')!r} {header.get('shape')}, "
                         f"expected uint8 {list(row_shape)}")


def child_error(header: dict) -> VlbatchError:
    """The typed error an "error" header names; names outside CHILD_ERRORS become `MediaError`."""
    kind, message = header.get("type"), header.get("message")
    if not isinstance(message, str):
        raise MediaError("the decoder sent an error without a message")
    cls = next((c for c in CHILD_ERRORS if c.__name__ == kind), MediaError)
    return cls(message)


def plan_header(plan: Plan) -> dict:
    """Child side: the "plan" header of a `Plan`."""
    return {"kind": "plan", "dtype": "uint8", "shape": list(plan.shape), "source_fps": plan.info.fps,
            "total_frames": plan.info.frames, "indices": list(plan.indices)}


def error_header(error: VlbatchError) -> dict:
    return {"kind": "error", "type": error.error_type, "message": str(error)}


def clip_header(clip: Clip, sampled) -> dict:
    """Child side: the "clip" header of a clip and its `clip_decode.SampledClip` (or its own `VlbatchError`)."""
    header = {"kind": "clip", "index": clip.index, "start": clip.start, "end": clip.end, "fps": clip.fps,
              "source": clip.source}
    if isinstance(sampled, VlbatchError):
        return {**header, "error": error_header(sampled)}
    return {**header, "dtype": "uint8", "shape": list(sampled.shape), "source_fps": sampled.source_fps,
            "total_frames": sampled.total_frames, "indices": list(sampled.indices)}


def parse_clip(header: dict, index: int, max_bytes: int) -> tuple[Clip, ClipHeader | VlbatchError]:
    """Check a "clip" header: the `index`-th clip (ids are built from it: never a repeat or a gap), frames
    [start, end) at a positive finite fps, cut as scenes | fixed, and its plan (`parse_plan`: frames
    within `max_bytes`, `total_frames == end - start`, indices within it) or its own error."""
    start, end, fps, source = (header.get(k) for k in ("start", "end", "fps", "source"))
    if header.get("index") != index or type(header.get("index")) is not int:
        raise MediaError(f"the decoder sent clip {str(header.get('index'))[:50]}, expected clip {index}")
    if type(start) is not int or type(end) is not int or not 0 <= start < end or type(fps) not in (int, float) \
            or not 0 < fps < math.inf or source not in ("scenes", "fixed"):
        shown = {k: header.get(k) for k in ("index", "start", "end", "fps", "source")}
        raise MediaError(f"the decoder sent a bad clip: {str(shown)[:300]}")
    clip = Clip(index=index, start=start, end=end, fps=float(fps), source=source)
    if "error" in header:
        if not isinstance(header["error"], dict):
            raise MediaError("the decoder sent a clip error that is not an object")
        return clip, child_error(header["error"])
    plan = parse_plan(header, max_bytes)
    if plan.total_frames != end - start or any(i >= plan.total_frames for i in plan.indices):
        raise MediaError(f"the decoder sent clip {index} of {end - start} frames with {plan.total_frames} "
                         f"frames and indices up to {max(plan.indices, default=0)}")
    return clip, plan


@dataclass(frozen=True)
class ClipFiles:
    """A clips request's clip files: encode each clip with `settings` into the parent's local `folder`
    (the child never sees the real target), except the clip indices in `skip` (committed)."""

    settings: ClipFileSettings
    folder: str
    skip: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClipFile:
    """A checked clip-file outcome from a "clip" header: `path` (the local file in the parent's folder),
    or `refused` (the codec's message: the rows stand without a file), or `failed` (the local write's
    message: the clip's rows fail); all None: skipped."""

    path: str | None = None
    refused: str | None = None
    failed: str | None = None


_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")


def parse_clip_file(header: dict, folder: str) -> ClipFile:
    """A "clip" header's clip-file outcome; `MediaError` for a name that is not a plain name of a regular
    file in `folder` (no "/", no "..", no link: a compromised child must not make the parent store, or
    delete, another file)."""
    name, refused, failed = (header.get(k) for k in ("file", "file_error", "file_failed"))
    for key, value in (("file_error", refused), ("file_failed", failed)):
        if value is not None and not isinstance(value, str):
            raise MediaError(f"the decoder sent a {key} that is not a string")
    if name is None:
        return ClipFile(refused=refused and refused[:500], failed=failed and failed[:500])
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise MediaError(f"the decoder named clip file {str(name)[:100]!r}, not a plain name in its folder; refused")
    path = os.path.join(folder, name)
    try:
        plain = stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        plain = False
    if not plain:
        raise MediaError(f"the decoder named clip file {name!r}, not a file in its folder; refused")
    return ClipFile(path=path)


def encode_request(backend: str, threads: int, sampling: FrameSampling, size: int, plan_only: bool = False,
                   clips: ClipRule | None = None, clip_files: ClipFiles | None = None) -> bytes:
    """Parent side: the request header as one message; `InputError` for a sampling JSON cannot carry.
    size: the byte count of the file sent with it (the child reads `[0, size)`); plan_only: the child
    sends the plan and "done", no frames (`DecodeWorker.plan`); clips: the child cuts the video into
    clips by this rule and sends each ("clip" headers, `DecodeWorker.decode_clips`); clip_files: it
    also writes each clip's file into the parent's folder."""
    try:
        return encode({"backend": backend, "threads": threads, "sampling": dataclasses.asdict(sampling),
                       "size": size, "plan_only": plan_only,
                       "clips": None if clips is None else dataclasses.asdict(clips),
                       "clip_files": None if clip_files is None else dataclasses.asdict(clip_files)})
    except (TypeError, ValueError) as e:
        raise InputError(f"the frame sampling cannot be sent to the decoder: {e}") from None


@dataclass(frozen=True)
class Request:
    """A request as the child reads it (from the trusted parent)."""

    backend: str
    threads: int
    sampling: FrameSampling
    size: int
    plan_only: bool
    clips: ClipRule | None
    clip_files: ClipFiles | None = None


def decode_request(raw: bytes) -> Request:
    """Child side: the request header as a `Request`."""
    request = json.loads(raw)
    clips, files = request.get("clips"), request.get("clip_files")
    if files is not None:
        files = ClipFiles(ClipFileSettings(**files["settings"]), str(files["folder"]), tuple(files["skip"]))
    return Request(request["backend"], request["threads"], FrameSampling(**request["sampling"]), int(request["size"]),
                   bool(request["plan_only"]), None if clips is None else ClipRule(**clips), files)
