"""CPU stages: decode (media bytes -> frames) and preprocess (frames -> model inputs),
as two stages or fused into one (`PrepareStage`).

Each stage is a class usable as a Ray Data actor-pool UDF: constructed once per actor
(opening the decode subprocess or loading the processor), called with a pyarrow batch of
the previous stage's rows, returning a pyarrow table with one row per input row (the
preprocess stage adds one error row per prompt that fails alone, `prepare_rows`). A failure
in one row becomes that row's error row; it never fails the task.
Rows already in error pass through unchanged. Ray Data runs several batches on one
actor at once (threads); the decode subprocess and the processor are not thread-safe,
so each call holds the actor's lock.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from vlbatch.operators.errors import InputError, SetupError
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.stages.clip_rows import clip_target, without_clip_file
from vlbatch.pipeline.stages.rows import Decoded, MediaTask, Prepared, clip_fields, from_table, to_table
from vlbatch.pipeline.telemetry.meter import DECODED, PREPROCESSED

if TYPE_CHECKING:  # annotations only: the processor is imported when the stage starts
    from vlbatch.operators.preprocess.processor import MediaInputs
    from vlbatch.operators.preprocess.user_text import ChatText


def _error_fields(row: MediaTask) -> dict:
    return {"status": row.status, "error_type": row.error_type, "error_message": row.error_message}


def _base(row: MediaTask) -> dict:
    return {"media_uri": row.media_uri, "media_type": row.media_type, "ids": row.ids,
            "request_indices": row.request_indices, "prompts": row.prompts, **_error_fields(row), "keep": row.keep,
            "prompt_names": row.prompt_names, **clip_fields(row)}


def _catch(row: MediaTask, fn, err_cls):
    """fn(), or the row as an error row: a typed `VlbatchError` keeps its class name (permanent
    or transient per `vlbatch.operators.errors`); any other exception (a bug, a library error) is
    recorded under its own name and counts as transient on resume. Never a task failure, except
    a `SetupError` (the job's own checkpoint or device is broken, not the medium): it fails the
    run, so no row of it is ever committed."""
    try:
        return fn()
    except SetupError:
        raise
    except Exception as e:
        return err_cls(**_base(row)).failed(e)


class DecodeStage:
    """MediaTask -> Decoded: the row's own bytes (`media_bytes`: WebDataset, embedded Parquet) or
    read them (local / s3:// / http(s)://, at most `storage.http_per_host` requests per host from
    this actor), decode the image or sampled video frames.

    Videos decode in a long-lived killable subprocess per actor (`DecodeWorker`), killed
    and restarted when a file exceeds `video.decode_timeout_s` (-> MediaTimeoutError); with
    `video.clips` the same child cuts and streams the clips (the limit runs between two clips).
    With `video.decode_device` cuda / model-cpu a video is only planned there (`DecodeWorker.plan`:
    metadata and sampled indices, no frame decoded) and its bytes ride on (`Decoded.deferred`).
    """

    def __init__(self, cfg: JobConfig, meter=None, done=None, ready: bool = True):
        from vlbatch.operators.media.video import FrameSampling
        from vlbatch.operators.media.worker import DecodeWorker
        from vlbatch.pipeline.stages.clip_rows import clip_target, resolve_done
        from vlbatch.pipeline.telemetry.meter import CPU_READY, MeterClient

        self.cfg = cfg
        self.storage = cfg.storage.options()
        v = cfg.video
        self.sampling = FrameSampling(fps=v.fps, num_frames=v.num_frames, min_frames=v.min_frames,
                                      max_frames=v.max_frames)
        self.worker = DecodeWorker(timeout_s=v.decode_timeout_s, preload=v.decoder)
        # the model stage decodes videos (`video.decode_device`): here only their plan; never in scan mode (no model)
        self.defer = v.decode_device != "cpu" and cfg.task.mode != "scan"
        self.lock = threading.Lock()
        from vlbatch.operators.storage.http import HostLimiter

        self.limiter = HostLimiter(cfg.storage.http_per_host)
        # video.clips: each video cut into clips, one row each (pipeline/stages/clip_rows.py); `done`: the
        # committed ids (an ObjectRef from the graph), the clips to drop on resume
        self.clips = v.clips.rule() if v.clips.mode != "none" else None
        self.done = resolve_done(done) if self.clips is not None else None
        self.clip_target = clip_target(cfg) if self.clips is not None else None  # output.clip_files
        self.meter = MeterClient(meter)
        if ready:  # one CPU actor ready (a fused PrepareStage counts once: its preprocess part)
            self.meter.ready(CPU_READY)

    def __call__(self, batch: pa.Table):
        rows = from_table(batch, MediaTask)
        if self.clips is not None:
            return self._clip_batches(rows)
        with self.lock:
            out = to_table([self.decode_one(r) for r in rows], Decoded)
        self.meter.add(DECODED, requests_of(rows))
        self.meter.flush()
        return out

    def _clip_batches(self, rows: list[MediaTask]):
        from vlbatch.pipeline.stages.clip_rows import clip_batches, cut_counted

        def count(out):
            self.meter.add(DECODED, requests_of(out))
            self.meter.flush()

        with self.lock:
            yield from clip_batches(rows, lambda r: cut_counted(self.decode_rows(r), self.meter), Decoded, count)

    def decode_rows(self, row: MediaTask):
        """The row's `Decoded` rows: one, or with `video.clips` one per clip of a video not committed."""
        if self.clips is None or row.status != "ok" or row.media_type != "video":
            yield self.decode_one(row)
            return
        from vlbatch.pipeline.stages.clip_rows import clip_rows

        yield from clip_rows(self, row, self._open_video)

    def decode_one(self, row: MediaTask) -> Decoded:
        if row.status != "ok":
            return Decoded(**_base(row))
        return _catch(row, lambda: self._decode(row), Decoded)

    def _read(self, row: MediaTask) -> bytes:
        """The media's bytes: the row's own, or read (at most its kind's `max_bytes`: InputError over it)."""
        from vlbatch.operators.storage import read_bytes

        limit, name = self._limit(row)
        if row.media_bytes is not None:
            return row.media_bytes
        # the size is checked before reading, and at most limit + 1 bytes are read (InputError over it)
        return read_bytes(row.media_uri, self.storage, max_bytes=limit, limit_name=name, limiter=self.limiter)

    def _open_video(self, row: MediaTask):
        """The video as a `MediaFile` for the decoder child (the caller closes it), its bytes held once
        (`storage.open_media`: a local file opened and checked, downloaded bytes in a sealed memfd); the
        row's own bytes copied into a sealed memfd."""
        from vlbatch.operators.storage import memfd_of, open_media

        limit, name = self._limit(row)
        if row.media_bytes is not None:
            return memfd_of(row.media_bytes)
        return open_media(row.media_uri, self.storage, max_bytes=limit, limit_name=name, limiter=self.limiter)

    def _limit(self, row: MediaTask) -> tuple[int, str]:
        """The row's kind's `max_bytes` and its name; the row's own bytes over it: `InputError`."""
        limit = self.cfg.image.max_bytes if row.media_type == "image" else self.cfg.video.max_bytes
        name = f"{row.media_type}.max_bytes"
        if row.media_bytes is not None and len(row.media_bytes) > limit:
            raise InputError(f"{row.media_uri}: {len(row.media_bytes)} bytes is over the {name} limit of {limit}")
        return limit, name

    def _decode(self, row: MediaTask) -> Decoded:
        t0 = time.perf_counter()
        if row.media_type == "image":
            from vlbatch.operators.media.image import load_image

            img = load_image(self._read(row))
            return Decoded(**_base(row), frames=img[None], decode_s=time.perf_counter() - t0)
        if self.defer:  # probe + sample in the child; the bytes travel on to the model stage
            data = self._read(row)
            plan = self.worker.plan(data, self.sampling)
            return Decoded(**_base(row), media_bytes=data, source_fps=plan.source_fps,
                           total_frames=plan.total_frames, frame_indices=plan.indices, plan_size=plan.shape[1:3],
                           decode_s=time.perf_counter() - t0)
        with self._open_video(row) as video:
            clip = self.worker.decode(video, self.sampling, self.cfg.video.decoder)
        return Decoded(**_base(row), frames=clip.frames, source_fps=clip.source_fps,
                       total_frames=clip.total_frames, frame_indices=tuple(int(i) for i in clip.indices),
                       decode_s=time.perf_counter() - t0)

    def __del__(self):
        w = getattr(self, "worker", None)
        if w is not None and hasattr(w, "close"):
            w.close()


def require_processor_files(model_dir: str) -> None:
    """SetupError (the actor does not start) when the checkpoint lacks a file the processor reads:
    every row would otherwise become a permanent error row (`pipeline/plan/checkpoint.py` checks the
    same at validate)."""
    from pathlib import Path

    from vlbatch.pipeline.plan.checkpoint import processor_problems

    problems = processor_problems(Path(model_dir))
    if problems:
        raise SetupError(f"model.path: {model_dir} " + "; ".join(problems))


def chat_messages(prompt: str, media_type: str, system_prompt: str | None) -> list[dict]:
    """The conversation for one request: optional system turn, then the media and the prompt."""
    msgs = [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}] if system_prompt else []
    msgs.append({"role": "user", "content": [{"type": media_type}, {"type": "text", "text": prompt}]})
    return msgs


class PreprocessStage:
    """Decoded -> Prepared: chat template, tokenisation, resize + patchify, MRoPE positions.

    The media's pixel work runs once per row, in the processor's uint8 mode (the resized
    levels in block-major order; the model side normalises them); its content hash is
    computed once here; the processor's text half runs once per prompt and gives each
    prompt's placeholder spans. `visual_tokens` is the number of placeholder tokens the
    media fills (`t * h * w / merge**2`), the unit model batches are sized by.
    """

    def __init__(self, cfg: JobConfig, meter=None):
        from vlbatch.operators.preprocess import Processor
        from vlbatch.pipeline.stages.backends import local_model_path
        from vlbatch.pipeline.telemetry.meter import CPU_READY, MeterClient

        self.cfg = cfg
        self.lock = threading.Lock()
        self.clip_target = clip_target(cfg) if cfg.video.clips.mode != "none" else None  # an error clip's file: deleted
        model_dir = local_model_path(cfg)
        require_processor_files(model_dir)
        self.processor = Processor.from_pretrained(model_dir)
        self._rendered: dict[tuple[str, str], str] = {}  # (prompt, kind) -> chat template text
        # the job's budgets override the checkpoint's preprocessor configs (None = keep)
        for attr, over in (("image_config", cfg.image), ("video_config", cfg.video)):
            kw = {k: getattr(over, k) for k in ("min_pixels", "max_pixels") if getattr(over, k) is not None}
            if kw:
                setattr(self.processor, attr, replace(getattr(self.processor, attr), **kw))
        self.meter = MeterClient(meter)
        self.meter.ready(CPU_READY)

    def __call__(self, batch: pa.Table):
        rows = from_table(batch, Decoded)
        with self.lock:
            out = to_table([p for r in rows for p in self.prepare_rows(r)], Prepared)
        self.meter.add(PREPROCESSED, requests_of(rows))
        self.meter.flush()
        return out

    def prepare_rows(self, row: Decoded) -> list[Prepared]:
        """The media's row of the prompts that preprocess, then one `InputError` row per prompt that
        does not (the chat template rejects it): a bad prompt never fails its media's others. A
        failure of the media itself (its pixels) is one error row for all of its requests."""
        if row.status != "ok":
            return [Prepared(**_base(row), decode_s=row.decode_s)]
        out = _catch(row, lambda: self._prepare_rows(row), Prepared)
        return without_clip_file(self.clip_target, row, out if isinstance(out, list) else [out])

    def prepare_one(self, row: Decoded) -> Prepared:
        """`prepare_rows(row)`'s first row: the media's row (its prompts that preprocess, or its error)."""
        return self.prepare_rows(row)[0]

    def _render(self, prompt: str, kind: str) -> ChatText:
        """The chat template's `ChatText` for one prompt about one media kind (its user text, the
        prompt and the system prompt, tokenised as text; cached: a job asks the same few prompts of
        every media; the system prompt and thinking flag are the job's)."""
        from vlbatch.operators.preprocess.prompt import cached

        return cached(self._rendered, (prompt, kind), lambda: self.processor.chat_text(
            chat_messages(prompt, kind, self.cfg.task.system_prompt),
            add_generation_prompt=True, enable_thinking=self.cfg.task.thinking))

    def media_kwargs(self, row: Decoded) -> dict:
        if row.media_type == "image":
            return {"images": [row.frames[0]]}
        from vlbatch.operators.types import VideoClip

        clip = VideoClip(frames=row.frames, source_fps=float(row.source_fps), total_frames=int(row.total_frames),
                         indices=tuple(row.frame_indices))
        return {"videos": [clip]}

    def _media(self, row: Decoded) -> tuple[MediaInputs, dict]:
        """(the media's `MediaInputs`, the Prepared fields of the shipped media) of one row: its resized
        frames and their hash, or for a deferred video its plan, bytes and `plan_hash`."""
        kind = row.media_type
        if not row.deferred:
            media = self.processor.encode_media(**self.media_kwargs(row), frames=True)
            pixels = media.arrays["pixel_values" if kind == "image" else "pixel_values_videos"]
            grid = tuple(media.arrays["image_grid_thw" if kind == "image" else "video_grid_thw"][0].tolist())
            return media, {"pixels": pixels, "content_hash": media_key(self.processor, kind, pixels, grid)}
        from vlbatch.operators.preprocess.shipped import DecodePlan, plan_hash
        from vlbatch.operators.types import VideoPlan

        h, w = row.plan_size
        _, media = self.processor.plan_media(VideoPlan(float(row.source_fps), int(row.total_frames),
                                                       tuple(row.frame_indices), int(h), int(w)))
        grid, cfg = media.arrays["video_grid_thw"][0], self.processor.video_config
        plan = DecodePlan.of(row.frame_indices, int(row.total_frames), grid, cfg.layout)
        return media, {
            "pixels": media.arrays["pixel_values_videos"], "media_bytes": row.media_bytes,
            "plan_indices": plan.indices, "plan_total_frames": plan.total_frames,
            "content_hash": plan_hash(kind, row.media_bytes, plan, grid, self.processor.norm_table(kind), cfg.layout)}

    def _prepare_rows(self, row: Decoded) -> list[Prepared]:
        from vlbatch.operators.engine.media_spans import placeholder_runs

        t0 = time.perf_counter()
        kind = row.media_type
        media, shipped = self._media(row)
        outs: dict[int, dict] = {}  # prompt index -> the processor's text outputs
        failed: list[Prepared] = []
        for i, prompt in enumerate(row.prompts):
            try:
                outs[i] = self.processor.encode_text(self._render(prompt, kind), media)
            except InputError as e:  # this prompt's own fault: its own error row
                bad = InputError(f"{row.media_uri}: request_index {row.request_indices[i]}: {e}")
                failed.append(Prepared(**_base(_only(row, [i])), decode_s=row.decode_s).failed(bad))
        if not outs:
            return failed
        grid = tuple(media.arrays["image_grid_thw" if kind == "image" else "video_grid_thw"][0].tolist())
        spans = [placeholder_runs(o["mm_token_type_ids"][0]) for o in outs.values()]
        ok = replace(Prepared(**_base(_only(row, list(outs)))), **shipped, grid_thw=grid,
                     input_ids=tuple(tuple(o["input_ids"][0].tolist()) for o in outs.values()),
                     spans=tuple(tuple(v for run in sp for v in run) for sp in spans),
                     positions=np.concatenate([o["position_ids"][:, 0] for o in outs.values()], axis=1),
                     rope_deltas=tuple(int(o["rope_deltas"][0]) for o in outs.values()),
                     visual_tokens=sum(e - s for s, e in spans[0]),  # placeholder tokens the media fills
                     decode_s=row.decode_s, preprocess_s=time.perf_counter() - t0)
        return [ok, *failed]


def _only(row: Decoded, keep: list[int]) -> Decoded:
    """`row` with only its requests at positions `keep` (all of them: the row itself)."""
    if len(keep) == len(row.ids):
        return row
    pick = lambda xs: tuple(xs[i] for i in keep)  # noqa: E731
    return replace(row, ids=pick(row.ids), request_indices=pick(row.request_indices), prompts=pick(row.prompts),
                   prompt_names=pick(row.prompt_names))


class PrepareStage:
    """MediaTask -> Prepared in one actor: `DecodeStage` then `PreprocessStage` per row.

    The fused CPU stage (`resources.fuse_cpu_stages`, sized by `resources.preprocess`):
    one actor pool and one process fewer than the two stages, and the decoded frames
    never leave the process (no Arrow conversion, no object-store copy). Same rows,
    same errors, same timings as the two stages in sequence.
    """

    def __init__(self, cfg: JobConfig, meter=None, done=None):
        self.decode = DecodeStage(cfg, meter, done, ready=False)
        self.preprocess = PreprocessStage(cfg, meter)
        self.lock = threading.Lock()

    def __call__(self, batch: pa.Table):
        rows = from_table(batch, MediaTask)
        if self.decode.clips is not None:  # clips: streamed, a few at a time (pipeline/stages/clip_rows.py)
            return self._clip_batches(rows)
        meter = self.preprocess.meter
        with self.lock:
            decoded = [self.decode.decode_one(r) for r in rows]
            meter.add(DECODED, requests_of(rows))
            out = to_table([p for r in decoded for p in self.preprocess.prepare_rows(r)], Prepared)
        meter.add(PREPROCESSED, requests_of(rows))
        meter.flush()
        return out


    def _clip_batches(self, rows: list[MediaTask]):
        from vlbatch.pipeline.stages.clip_rows import clip_batches, cut_counted

        meter = self.preprocess.meter

        def each(row):
            for d in cut_counted(self.decode.decode_rows(row), meter):
                meter.add(DECODED, len(d.ids))
                yield from self.preprocess.prepare_rows(d)

        def count(out):
            meter.add(PREPROCESSED, requests_of(out))
            meter.flush()

        with self.lock:
            yield from clip_batches(rows, each, Prepared, count)


def requests_of(rows) -> int:
    """Output rows (requests) of a list of media rows."""
    return sum(len(r.ids) for r in rows)


def process_prompts(proc, texts: list[str], images: list[np.ndarray] | None = None, videos: list | None = None, *,
                    uint8: bool = False,
                    frames: bool = False) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """`[proc(text=t, images=..., videos=...) for t in texts]` with the pixel work done once.

    Returns (visual, per_text): `visual` holds the prompt-independent outputs
    (`pixel_values` [N, D] / `image_grid_thw` [M, 3], or the `_videos` pair), computed once
    for the media (uint8 levels with `uint8`, one media's resized frames with `frames`:
    `Processor.encode_media`); `per_text[i]` holds
    text i's `input_ids`, `attention_mask`, `mm_token_type_ids` [1, L_i], `position_ids`
    [3, 1, L_i] and `rope_deltas` [1], the values `proc(text=texts[i], ...)` returns
    (`process_prompts_naive` is that loop).
    """
    media = proc.encode_media(images, videos, uint8=uint8, frames=frames)
    return media.arrays, [proc.encode_text(text, media) for text in texts]


def process_prompts_naive(proc, texts: list[str], **media) -> list[dict[str, np.ndarray]]:
    """The reference for `process_prompts`: the whole processor once per text."""
    return [proc(text=t, **media) for t in texts]


def media_key(processor, kind: str, frames: np.ndarray, grid: tuple[int, int, int]) -> str:
    """The content hash of a media's resized uint8 frames `[F, h, w, 3]`, computed once on the
    CPU stage (`media_hash` with the kind's table and layout, as `MediaItem` would)."""
    from vlbatch.operators.preprocess.shipped import media_hash

    cfg = processor.image_config if kind == "image" else processor.video_config
    return media_hash(kind, frames, grid, processor.norm_table(kind), cfg.layout)
