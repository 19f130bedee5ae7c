"""`video.clips` in the CPU stage: one video row -> one `Decoded` row per clip, streamed.

A video is decoded once, in the actor's killable decoder child (`stage.worker.decode_clips`:
`operators/media/clip_decode`'s fixed windows or scene cuts, each clip sampled as the reference
samples a video of its length, streamed clip by clip through the frame ring) and each clip becomes its own
media row: its requests' ids are `requests.clip_request_id(video request id, clip index)`, its
`clip_*` fields say where it is in the source (seconds) and how it was cut (scenes | fixed). A clip
whose ids are all committed (`done`: resume) is dropped here, before any preprocess or model work,
so an interrupted video resumes at its first clip not committed. A failure of the whole file
(not a video) is one error row under the video's own ids; so is the rest of a video whose decode
hangs (`video.decode_timeout_s` between two clips: the child is killed, MediaTimeoutError) or
crashes (MediaError) after some clips: those clips' rows stand, the error row stands for the clips
not sent (resume retries it and drops the committed clips). A clip's own failure (too many bytes
to sample) is that clip's error row.

The stages hand rows on in blocks of `CLIP_BLOCK` clips (`clip_batches`, a generator Ray Data
streams), so a long video never holds more than that many clips' frames in the actor.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pyarrow as pa

from vlbatch.operators.errors import SetupError, VlbatchError
from vlbatch.pipeline.stages.requests import clip_request_id, pending
from vlbatch.pipeline.stages.rows import Decoded, MediaTask, to_table

CLIP_BLOCK = 4  # clips per output block: bounds the frames a long video holds in the actor


def resolve_done(done):
    """The committed ids (`IdIndex`) from the graph's ObjectRef (None: a fresh run, nothing to drop)."""
    if done is None:
        return None
    import ray

    return ray.get(done) if isinstance(done, ray.ObjectRef) else done


def clip_rows(stage, row: MediaTask, data_of: Callable[[MediaTask], bytes]) -> Iterator[Decoded]:
    """The `Decoded` rows of one video row's clips not committed (`stage`: the `DecodeStage`, its
    rule, sampling and `done`; `data_of(row)`: the video's bytes)."""
    base = {k: getattr(row, k)
            for k in ("media_uri", "media_type", "request_indices", "prompts", "keep", "prompt_names")}
    t0 = time.perf_counter()
    try:
        clips = stage.worker.decode_clips(data_of(row), stage.clips, stage.sampling)  # in the killable child
        for clip, result in clips:
            task = MediaTask(ids=tuple(clip_request_id(rid, clip.index) for rid in row.ids), **base,
                             clip_index=clip.index, clip_start_s=clip.start_s, clip_end_s=clip.end_s,
                             clip_source=clip.source)
            task = pending(task, stage.done) if stage.done is not None else task
            if task is None:  # every request of this clip is committed
                t0 = time.perf_counter()
                continue
            fields = {f: getattr(task, f) for f in MediaTask.__dataclass_fields__}
            if isinstance(result, VlbatchError):
                yield Decoded(**fields).failed(result)
            else:
                yield Decoded(**fields, frames=result.frames, source_fps=result.source_fps,
                              total_frames=result.total_frames, frame_indices=result.indices,
                              decode_s=time.perf_counter() - t0)
            t0 = time.perf_counter()
    except SetupError:
        raise
    except Exception as e:  # the whole file: one error row under the video's own ids
        fields = {f: getattr(row, f) for f in MediaTask.__dataclass_fields__}
        yield Decoded(**{**fields, "media_bytes": None}).failed(e)


def clip_batches(rows: list[MediaTask], each: Callable[[MediaTask], Iterator], cls: type,
                 count: Callable[[list], None]) -> Iterator[pa.Table]:
    """Tables of `cls` rows of `each(row)` for every row, `CLIP_BLOCK` at a time (`count(rows)` told
    each block's rows before it is handed on)."""
    buf: list = []
    for row in rows:
        for out in each(row):
            buf.append(out)
            if len(buf) >= CLIP_BLOCK:
                count(buf)
                yield to_table(buf, cls)
                buf = []
    if buf:
        count(buf)
        yield to_table(buf, cls)
