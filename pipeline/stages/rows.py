"""Typed row schemas of the stages (frozen dataclasses <-> Arrow tables).

A row is one *media* with the pending requests about it (ids, indices, prompts), so
every question about a media travels together: decoded and preprocessed once, sent to
one model actor in one batch (its vision and prefix caches hit), and split into one
output row per request only by the writer. Each stage maps one row to one row, except that
preprocessing splits off a prompt that fails alone (the template rejects it) as its own
error row (`PreprocessStage.prepare_rows`).

Tensor fields (`frames`, `pixels`) travel as plain Arrow struct columns
(`TENSOR_TYPE`: shape, numpy dtype string, the C-order bytes), never as pickled Python
objects; reading one back is zero-copy (a read-only numpy view of the Arrow buffer). An error row keeps its request
fields, carries `status="error"`, `error_type`, `error_message`, and empty tensors.

Stages:  MediaTask -> Decoded -> Prepared -> Generated  (-> writer OutputRows)
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import pyarrow as pa

TENSOR = "tensor"
TENSOR_TYPE = pa.struct([("shape", pa.list_(pa.int64())), ("dtype", pa.string()), ("data", pa.large_binary())])
_LS, _LI = pa.list_(pa.string()), pa.list_(pa.int64())


@dataclass(frozen=True)
class MediaTask:
    """One media and its pending requests (request i: ids[i], request_indices[i], prompts[i],
    prompt_names[i]: task.questions' name, "caption", or None for a manifest's question; an empty
    tuple is read as all None)."""

    media_uri: str
    media_type: str  # "image" | "video"
    ids: tuple[str, ...]
    request_indices: tuple[int, ...]
    prompts: tuple[str, ...]
    status: str = "ok"
    error_type: str | None = None
    error_message: str | None = None
    # the media itself when the input carries it (not read again); dropped after decode
    media_bytes: bytes | None = None
    keep: bytes | None = None  # input.columns.keep values (pipeline/sources/keep.py), carried to the writer
    # one clip of a video (`video.clips`, operators/media/clips.py): its index, seconds in the source's
    # timeline and how it was cut (scenes | fixed); None for images and whole videos
    clip_index: int | None = None
    clip_start_s: float | None = None
    clip_end_s: float | None = None
    clip_source: str | None = None
    # the video's last clip (its clip set ends here; the rerun check `nothing_to_do.py` reads it); None: no clip
    clip_last: bool | None = None
    clip_uri: str | None = None  # the clip's file (`output.clip_files`, operators/media/clip_files.py); else None
    prompt_names: tuple[str | None, ...] = ()

    def __post_init__(self):
        if len(self.prompt_names) != len(self.ids):  # () (a row made without names): every request unnamed
            object.__setattr__(self, "prompt_names", (None,) * len(self.ids))

    def failed(self, err: BaseException) -> Any:
        """The same row as an error row (`err`'s class name and message, without object addresses)."""
        from vlbatch.operators.errors import stable_message

        return replace(self, status="error", error_type=type(err).__name__, error_message=stable_message(str(err)))


@dataclass(frozen=True)
class Decoded(MediaTask):
    """frames: [F, H, W, 3] uint8 (F = 1 for an image); empty on error."""

    frames: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0, 3), np.uint8))
    source_fps: float | None = None
    total_frames: int | None = None
    frame_indices: tuple[int, ...] = ()
    decode_s: float = 0.0
    plan_size: tuple[int, ...] = ()  # (H, W) upright: a video planned, not decoded (`deferred`)

    @property
    def deferred(self) -> bool:
        """The video's decode is deferred to the model stage (`video.decode_device`): `frames` is
        empty, `media_bytes` holds the video and `frame_indices` / `total_frames` its plan."""
        return bool(self.plan_size)


@dataclass(frozen=True)
class Prepared(MediaTask):
    """The engine-ready input of one media, built once for all its prompts.

    pixels: [F, H, W, 3] uint8, the resized frames (the model side makes the block-major
    patches and normalises them with the checkpoint's table on its device,
    `normalize_frames`: 4x fewer bytes than float32 patches, 8x for a still image, which the
    patch layout repeats in every temporal slot); grid_thw: (t, h, w) in patches;
    content_hash: `media_hash` of kind, frames, grid, layout and table (computed once here).
    A deferred video (`video.decode_device`: cuda / model-cpu) ships `media_bytes` and its
    plan (`plan_indices`, `plan_total_frames`) instead of `pixels` (empty `[0, h, w, 3]`); its
    content_hash is `plan_hash`; the model stage makes the frames (`DecodePlan.frames`).
    Per prompt i: input_ids[i] [L_i], spans[i] the placeholder runs flattened (s0, e0, s1, e1,
    ...), rope_deltas[i]; positions: int64 [3, sum_i L_i], every prompt's MRoPE positions
    side by side in prompt order (`prompt_positions(i)` is prompt i's [3, L_i], a view: a
    1080p image's prompts carry ~10^4 ids each, which as Python ints cost ms per row)."""

    pixels: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0, 3), np.uint8))
    grid_thw: tuple[int, ...] = ()
    content_hash: str = ""
    input_ids: tuple[tuple[int, ...], ...] = ()
    spans: tuple[tuple[int, ...], ...] = ()
    positions: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.int64))
    rope_deltas: tuple[int, ...] = ()
    visual_tokens: int = 0
    decode_s: float = 0.0
    preprocess_s: float = 0.0
    plan_indices: tuple[int, ...] = ()  # a deferred video: the sampled indices of `media_bytes`
    plan_total_frames: int | None = None  # and the frames it holds (`operators/preprocess/shipped.DecodePlan`)

    @property
    def deferred(self) -> bool:
        """`pixels` is empty: the model stage decodes `media_bytes` by the plan (`DecodePlan.of`)."""
        return bool(self.plan_indices)

    def prompt_positions(self, i: int) -> np.ndarray:
        """Prompt i's MRoPE positions int64 [3, L_i] (a view of `positions`)."""
        start = sum(len(ids) for ids in self.input_ids[:i])
        return self.positions[:, start:start + len(self.input_ids[i])]

    def prompt_spans(self, i: int) -> tuple[tuple[int, int], ...]:
        """Prompt i's placeholder runs as (start, end) pairs."""
        flat = self.spans[i]
        return tuple(zip(flat[0::2], flat[1::2], strict=True))

    def only(self, keep: tuple[int, ...]) -> Prepared:
        """The same media with only prompts `keep` (in that order): every per-prompt field taken at
        those indices, `positions` cut to theirs; the media itself (pixels, grid, hash) shared."""
        def pick(t: tuple) -> tuple:
            return tuple(t[i] for i in keep) if t else t

        pos = np.concatenate([self.prompt_positions(i) for i in keep], axis=1) if keep else self.positions[:, :0]
        return replace(self, ids=pick(self.ids), request_indices=pick(self.request_indices), prompts=pick(self.prompts),
                       prompt_names=pick(self.prompt_names),
                       input_ids=pick(self.input_ids), spans=pick(self.spans), rope_deltas=pick(self.rope_deltas),
                       positions=pos)


@dataclass(frozen=True)
class Generated(MediaTask):
    """Per prompt i: answers[i], statuses[i] ("ok"/"error"), req_error_types[i], ..."""

    answers: tuple[str | None, ...] = ()
    parsed: tuple[str | None, ...] = ()  # a constrained answer's value as JSON text, else None
    thinking: tuple[str | None, ...] = ()
    statuses: tuple[str, ...] = ()
    req_error_types: tuple[str | None, ...] = ()
    req_error_messages: tuple[str | None, ...] = ()
    finish_reasons: tuple[str | None, ...] = ()
    prompt_tokens: tuple[int | None, ...] = ()
    generated_tokens: tuple[int | None, ...] = ()
    cached_tokens: tuple[int | None, ...] = ()
    visual_tokens: int = 0
    decode_s: float = 0.0
    preprocess_s: float = 0.0
    model_s: float = 0.0
    # the model's work since the actor's previous call returned, on a call's first ok row only
    # (calls overlap, so this is an attribution; the sums over all rows are the actor's totals)
    vision_hits: int = 0  # vision-cache hits
    vision_encodes: int = 0  # vision tower runs
    batch_model_s: float = 0.0  # seconds the engine computed
    batch_model_cpu_s: float = 0.0  # CPU seconds of the engine's thread in them

    def __post_init__(self):
        super().__post_init__()
        if len(self.parsed) != len(self.ids):  # () (no structured answers): every request's parsed is null
            object.__setattr__(self, "parsed", (None,) * len(self.ids))


_BASE = {
    "media_uri": pa.string(), "media_type": pa.string(), "ids": _LS, "request_indices": _LI, "prompts": _LS,
    "status": pa.string(), "error_type": pa.string(), "error_message": pa.string(),
    "media_bytes": pa.large_binary(), "keep": pa.large_binary(), "prompt_names": _LS, "clip_index": pa.int64(),
    "clip_start_s": pa.float64(), "clip_end_s": pa.float64(), "clip_source": pa.string(), "clip_last": pa.bool_(),
    "clip_uri": pa.string(),
}
CLIP_FIELDS = ("clip_index", "clip_start_s", "clip_end_s", "clip_source", "clip_last", "clip_uri")


def clip_fields(row: MediaTask) -> dict:
    """The clip fields of `row` (None for images and whole videos), to carry into the next stage's row."""
    return {k: getattr(row, k) for k in CLIP_FIELDS}
ARROW_TYPES: dict[type, dict[str, Any]] = {
    MediaTask: _BASE,
    Decoded: {**_BASE, "frames": TENSOR, "source_fps": pa.float64(), "total_frames": pa.int64(),
              "frame_indices": _LI, "decode_s": pa.float64(), "plan_size": _LI},
    Prepared: {**_BASE, "pixels": TENSOR, "grid_thw": _LI, "content_hash": pa.string(), "input_ids": pa.list_(_LI),
               "spans": pa.list_(_LI), "positions": TENSOR, "rope_deltas": _LI,
               "visual_tokens": pa.int64(), "decode_s": pa.float64(), "preprocess_s": pa.float64(),
               "plan_indices": _LI, "plan_total_frames": pa.int64()},
    Generated: {**_BASE, "answers": _LS, "parsed": _LS, "thinking": _LS, "statuses": _LS, "req_error_types": _LS,
                "req_error_messages": _LS, "finish_reasons": _LS, "prompt_tokens": _LI,
                "generated_tokens": _LI, "cached_tokens": _LI, "visual_tokens": pa.int64(),
                "decode_s": pa.float64(), "preprocess_s": pa.float64(), "model_s": pa.float64(),
                "vision_hits": pa.int64(), "vision_encodes": pa.int64(), "batch_model_s": pa.float64(),
                "batch_model_cpu_s": pa.float64()},
}


def columns(cls: type) -> list[str]:
    """The columns a stage reading rows of `cls` needs."""
    return [f.name for f in fields(cls)]


def to_table(rows: list, cls: type) -> pa.Table:
    """[cls] -> pa.Table with `ARROW_TYPES[cls]` (tensor fields as variable-shaped tensors)."""
    types = ARROW_TYPES[cls]
    cols = {}
    for name in columns(cls):
        vals = [getattr(r, name) for r in rows]
        if types[name] == TENSOR:
            cols[name] = tensors_to_arrow(vals)
        else:
            cols[name] = pa.array(vals, type=types[name])
    return pa.table(cols)


def from_table(table: pa.Table, cls: type) -> list:
    """pa.Table -> [cls]: every stage's input. Lists become tuples by the column's Arrow type
    (not element by element: a 1080p image's prompts carry ~10^4 position ids per row)."""
    types = ARROW_TYPES[cls]
    cols = {}
    for name in columns(cls):
        col = table.column(name)
        if types[name] == TENSOR:
            cols[name] = _tensor_list(col)
        elif pa.types.is_list(types[name]) and pa.types.is_list(types[name].value_type):
            cols[name] = [None if v is None else tuple(tuple(x) if x is not None else None for x in v)
                          for v in col.to_pylist()]
        elif pa.types.is_list(types[name]):
            cols[name] = [None if v is None else tuple(v) for v in col.to_pylist()]
        else:
            cols[name] = col.to_pylist()
    names = list(cols)
    return [cls(**dict(zip(names, vals, strict=True))) for vals in zip(*cols.values(), strict=True)]


def tensors_to_arrow(arrays: list[np.ndarray]) -> pa.StructArray:
    """[n] numpy arrays of any shapes and dtypes -> one `TENSOR_TYPE` column (one copy of the data)."""
    arrays = [np.asarray(a) for a in arrays]
    flat = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    offsets = np.zeros(len(flat) + 1, np.int64)
    np.cumsum([f.size for f in flat], out=offsets[1:])
    data = np.concatenate(flat) if flat else np.zeros(0, np.uint8)
    blobs = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(flat),
                                             [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    shapes = pa.array([list(a.shape) for a in arrays], pa.list_(pa.int64()))
    dtypes = pa.array([a.dtype.str for a in arrays], pa.string())
    return pa.StructArray.from_arrays([shapes, dtypes, blobs], fields=list(TENSOR_TYPE))


def _tensor_list(col: pa.ChunkedArray) -> list[np.ndarray]:
    """A `TENSOR_TYPE` column -> its arrays (read-only views of the Arrow buffers)."""
    out: list[np.ndarray] = []
    for chunk in col.chunks:
        shapes, dtypes, blobs = chunk.flatten()  # children with the chunk's slice applied
        _, off_buf, data_buf = blobs.buffers()
        offsets = np.frombuffer(off_buf, np.int64)[blobs.offset: blobs.offset + len(blobs) + 1]
        raw = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        for shape, dt, lo, hi in zip(shapes.to_pylist(), dtypes.to_pylist(), offsets[:-1], offsets[1:], strict=True):
            out.append(raw[lo:hi].view(np.dtype(dt)).reshape(shape))
    return out
