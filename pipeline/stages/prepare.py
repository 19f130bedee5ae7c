"""The fused CPU stage (`PrepareStage`): decode then preprocess in one actor pool (`resources.fuse_cpu_stages`)."""
from __future__ import annotations

import threading

import pyarrow as pa

from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.stages.decode import DecodeStage
from vlbatch.pipeline.stages.preprocess import PreprocessStage
from vlbatch.pipeline.stages.row_fields import requests_of
from vlbatch.pipeline.stages.rows import MediaTask, Prepared, from_table, to_table
from vlbatch.pipeline.telemetry.meter import DECODED, PREPROCESSED


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
