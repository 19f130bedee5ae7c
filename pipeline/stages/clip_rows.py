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

Clip files (`output.clip_files`, `_ClipFiles`): the child encodes each clip into the worker's local temporary
folder (its encode counts in `video.decode_timeout_s`) and names the file; this process stores it at the run's
target (`clip_files.store_clip`) before the clip's rows are handed on. The child is told the committed clips
from clip 0 on (a resumed video's), which it does not encode; a later committed clip's file is dropped here.

`clip_last` is true on the rows of a video's last clip (`with_last`: each clip is handed on once the
next one has decoded, or the decode ended), so the committed rows say when a video's clip set is
complete: the rerun check (`nothing_to_do.py`) decides "all committed" from them without decoding.
A decode that fails after some clips hands the held clip on (not last) before its error row.

The stages hand rows on in blocks of `CLIP_BLOCK` clips (`clip_batches`, a generator Ray Data
streams), so a long video never holds more than that many clips' frames in the actor.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import pyarrow as pa

from vlbatch.operators.errors import SetupError, StorageError, VlbatchError, stable_message
from vlbatch.operators.storage import MediaFile
from vlbatch.pipeline.stages.requests import clip_request_id, pending
from vlbatch.pipeline.stages.rows import Decoded, MediaTask, to_table
from vlbatch.pipeline.telemetry.meter import CLIP_FRAMES, CLIPS, MEDIA_CUT

LOG = logging.getLogger("vlbatch.clip_files")
T = TypeVar("T")
CLIP_BLOCK = 4  # clips per output block: bounds the frames a long video holds in the actor


def clip_target(cfg):
    """The run's `ClipTarget` (`clips_folder` of `<output.uri>/<run id>`, the output's storage options), None
    when `output.clip_files` is off."""
    files = cfg.output.clip_files
    if files is None:
        return None
    from vlbatch.operators.media.clip_files import ClipTarget, clips_folder
    from vlbatch.operators.storage import join

    run_dir = join(cfg.output.uri.rstrip("/"), cfg.resolved_run_id())  # as pipeline/graph.py names the run
    return ClipTarget(folder=clips_folder(run_dir), settings=files.settings(), storage=cfg.storage.options())


def without_clip_file(target, row, out: list) -> list:
    """`out`, the Prepared rows of the clip `row`: when none is ok (the clip ended as error rows after
    decode, e.g. refused by preprocess), its stored clip file is deleted and no row names it, so a clip
    file always belongs to a clip with an answer."""
    if target is None or row.clip_uri is None or any(p.status == "ok" for p in out):
        return out
    from dataclasses import replace

    try:
        target.remove(row.clip_uri)
    except VlbatchError as e:  # the rows stand; the file stays, named by none of them
        LOG.warning("clip file %s of an error clip not deleted: %s", row.clip_uri, e)
    return [replace(p, clip_uri=None) for p in out]


def resolve_done(done):
    """The committed ids (`IdIndex`) from the graph's ObjectRef (None: a fresh run, nothing to drop)."""
    if done is None:
        return None
    import ray

    return ray.get(done) if isinstance(done, ray.ObjectRef) else done


def clip_rows(stage, row: MediaTask, data_of: Callable[[MediaTask], bytes | MediaFile]) -> Iterator[Decoded]:
    """The `Decoded` rows of one video row's clips not committed (`stage`: the `DecodeStage`, its
    rule, sampling, `done`, `worker` and `clip_target` (None: no clip files); `data_of(row)`: the video's
    bytes, or its `MediaFile`, closed here). The decode, and the clip files' encode, run in the actor's killable
    decoder child."""
    base = {k: getattr(row, k)
            for k in ("media_uri", "media_type", "request_indices", "prompts", "keep", "prompt_names")}
    files = _ClipFiles(stage.clip_target, row, stage.done)
    t0 = time.perf_counter()
    video = None
    try:
        extra = {} if stage.clip_target is None else {
            "clip_files": stage.clip_target.settings, "skip": files.committed(), "on_file": files.store}
        video = data_of(row)
        clips = stage.worker.decode_clips(video, stage.clips, stage.sampling, **extra)
        for (clip, result), last in with_last(clips):
            task = _clip_task(row, base, clip, last, stage.done)
            if task is None:  # every request of this clip is committed
                t0 = time.perf_counter()
                continue
            fields = {f: getattr(task, f) for f in MediaTask.__dataclass_fields__}
            uri, failure = files.outcome(clip.index)
            fields["clip_uri"] = uri
            if isinstance(result, VlbatchError) or failure is not None:
                yield Decoded(**fields).failed(failure or result)
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
    finally:
        if isinstance(video, MediaFile):
            video.close()


def _clip_task(row: MediaTask, base: dict, clip, last: bool, done) -> MediaTask | None:
    """The clip's `MediaTask` (its own ids; `last`: the video's last clip), its committed requests left out;
    None when all are."""
    task = MediaTask(ids=tuple(clip_request_id(rid, clip.index) for rid in row.ids), **base,
                     clip_index=clip.index, clip_start_s=clip.start_s, clip_end_s=clip.end_s, clip_source=clip.source,
                     clip_last=last)
    return pending(task, done) if done is not None else task


class _ClipFiles:
    """One video's clip files (`output.clip_files`): `committed()` -> the clip indices the child need not
    encode; `store(clip, file)` is `DecodeWorker.decode_clips`' `on_file`, called before each clip is yielded
    with the child's local file (`wire.ClipFile`); `outcome(index)` -> (its URI or None, the storage error that
    fails its rows or None). Failures: `operators/media/clip_files.py`'s docstring."""

    def __init__(self, target, row: MediaTask, done):
        self.target, self.row, self.done = target, row, done
        # clip index -> (URI or None, failure or None); at most two held: `with_last` keeps one clip back
        self.outcomes: dict[int, tuple[str | None, Exception | None]] = {}

    def _is_committed(self, index: int) -> bool:
        return self.done is not None and all(clip_request_id(rid, index) in self.done for rid in self.row.ids)

    def committed(self) -> list[int]:
        """The committed clips from clip 0 on, up to the first one not committed: a resumed video's
        committed clips are its first ones (it resumes at its first clip not committed); a later committed
        clip (after a clip whose file failed) is encoded by the child and dropped by `store`, since the
        clip count is not known before the decode."""
        out: list[int] = []
        while self._is_committed(len(out)):
            out.append(len(out))
        return out

    def store(self, clip, file) -> None:
        from vlbatch.operators.media.clip_files import clip_file_name, store_clip

        self.outcomes[clip.index] = (None, None)
        if self._is_committed(clip.index):  # its rows are not redone, so neither is its file
            if file.path is not None:
                os.unlink(file.path)  # checked: a plain file in the worker's folder
            return
        if file.refused is not None:  # the codec refused: the caption stands without a file
            LOG.warning("clip %d of %s: no clip file (%s)", clip.index, self.row.media_uri,
                        stable_message(file.refused))
        elif file.failed is not None:  # the child's local disk: the clip's rows fail, resume redoes them
            self.outcomes[clip.index] = (None, StorageError(f"writing clip file {clip.index}: {file.failed}"))
        elif file.path is not None:
            try:
                uri = store_clip(self.target, clip_file_name(self.row.media_uri, clip.index), file.path)
                self.outcomes[clip.index] = (uri, None)
            except Exception as e:  # storage (StorageError, an OSError): the clip's rows fail, resume redoes them
                self.outcomes[clip.index] = (None, e)

    def outcome(self, index: int) -> tuple[str | None, Exception | None]:
        return self.outcomes.pop(index, (None, None))


def cut_counted(decoded: Iterable[Decoded], meter) -> Iterator[Decoded]:
    """One media row's `Decoded` rows, telling `meter` (a `MeterClient`) each clip and then the media cut:
    a clipped run's progress (`telemetry/progress.py`) counts media, not rows, before the decode."""
    for d in decoded:
        if d.clip_index is not None:
            meter.add(CLIPS, 1)
            meter.add(CLIP_FRAMES, len(d.frame_indices))
        yield d
    meter.add(MEDIA_CUT, 1)


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """(item, last) for each of `items`, one held back until the next arrives (or the stream ends: last).
    An error raised by `items` hands the held item on, not last, then is raised."""
    it = iter(items)
    try:
        held = next(it)
    except StopIteration:
        return
    while True:
        try:
            nxt = next(it)
        except StopIteration:
            yield held, True
            return
        except Exception:
            yield held, False
            raise
        yield held, False
        held = nxt


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
