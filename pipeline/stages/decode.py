"""The decode stage (`DecodeStage`): media bytes -> frames, a CPU actor pool (row helpers: `row_fields.py`)."""
from __future__ import annotations

import threading
import time

import pyarrow as pa

from vlbatch.operators.errors import InputError
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.stages.row_fields import base_fields, catch_row, requests_of
from vlbatch.pipeline.stages.rows import Decoded, MediaTask, from_table, to_table
from vlbatch.pipeline.telemetry.meter import DECODED


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
            return Decoded(**base_fields(row))
        return catch_row(row, lambda: self._decode(row), Decoded)

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
            return Decoded(**base_fields(row), frames=img[None], decode_s=time.perf_counter() - t0)
        if self.defer:  # probe + sample in the child; the bytes travel on to the model stage
            data = self._read(row)
            plan = self.worker.plan(data, self.sampling)
            return Decoded(**base_fields(row), media_bytes=data, source_fps=plan.source_fps,
                           total_frames=plan.total_frames, frame_indices=plan.indices, plan_size=plan.shape[1:3],
                           decode_s=time.perf_counter() - t0)
        with self._open_video(row) as video:
            clip = self.worker.decode(video, self.sampling, self.cfg.video.decoder)
        return Decoded(**base_fields(row), frames=clip.frames, source_fps=clip.source_fps,
                       total_frames=clip.total_frames, frame_indices=tuple(int(i) for i in clip.indices),
                       decode_s=time.perf_counter() - t0)

    def __del__(self):
        w = getattr(self, "worker", None)
        if w is not None and hasattr(w, "close"):
            w.close()
