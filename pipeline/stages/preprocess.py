"""The preprocess stage (`PreprocessStage`): frames -> model inputs, a CPU actor pool (row helpers: `row_fields.py`;
decode and preprocess fused in one pool: `prepare.py`)."""
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
from vlbatch.pipeline.stages.row_fields import base_fields, catch_row, requests_of
from vlbatch.pipeline.stages.rows import Decoded, Prepared, from_table, to_table
from vlbatch.pipeline.telemetry.meter import PREPROCESSED

if TYPE_CHECKING:  # annotations only: the processor is imported when the stage starts
    from vlbatch.operators.preprocess.processor import MediaInputs
    from vlbatch.operators.preprocess.user_text import ChatText


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
        from vlbatch.pipeline.stages.model_place import local_model_path
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
            return [Prepared(**base_fields(row), decode_s=row.decode_s)]
        out = catch_row(row, lambda: self._prepare_rows(row), Prepared)
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
                failed.append(Prepared(**base_fields(_only(row, [i])), decode_s=row.decode_s).failed(bad))
        if not outs:
            return failed
        grid = tuple(media.arrays["image_grid_thw" if kind == "image" else "video_grid_thw"][0].tolist())
        spans = [placeholder_runs(o["mm_token_type_ids"][0]) for o in outs.values()]
        ok = replace(Prepared(**base_fields(_only(row, list(outs)))), **shipped, grid_thw=grid,
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
