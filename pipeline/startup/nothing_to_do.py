"""Nothing to do: a rerun whose input is all committed, found in the driver before Ray starts (issue 50).

`open_run(plan) -> OpenedRun`, called by `vlbatch run` (`jobs/local.py`) after the preflight, opens the run's
sink and reads its committed index once (handed to `pipeline/graph.run_job`, which reads neither again), then
`nothing_to_do(plan, sink, index) -> NothingToDo | None` decides:
a `NothingToDo` when every request id of the input is committed as ok or permanent error (a transient error
row is redone on resume: work; so is a TruncatedError row cut at fewer tokens than this run's max_tokens),
the sink holds no id twice and no transient row to purge (a run would tidy those); then the run prints
`line()` and exits with `exit_code` (the committed error rows against `max_error_fraction` and
`min_error_rows`, the summary's rule and words) without starting Ray; `_summary.json` stays as it is.
None: the run goes on as before (Ray starts, `pipeline/graph.run_job` resumes). The check only reads (the
committed index, the input); on nothing to do it writes `_fingerprint.json` where a run would (a config change
accepted by `resume.allow_config_change`, a folder from before fingerprints: the plan's fingerprint note), nothing
else. The input is read (`driver_blocks`) only when the index holds committed rows: a fresh run reads nothing here.

The ids are computed as the expansion stage computes them (`requests.expand_rows` per manifest row) from
the rows the source can give in the driver (`Source.driver_blocks`: a local manifest of URIs, a glob's
listing, made once by the preflight); a source that cannot (WebDataset shards, remote or embedded-bytes
manifests) returns None and is never read here. The walk stops at the first block holding a pending id.
With `video.clips` a video's requests are its clips' (`requests.clip_request_id(video's id, k)`), known only
once it is decoded: a video request is covered when its own id is committed (the whole file failed) or its
clips 0, 1, ... are each committed up to one whose row says `clip_last` (the sink's `last_clip_ids`); a
missing clip, or none marked last (rows written before the marker existed), is work left (`clip_keys`).
With `input.columns.keep` a request id seen twice is refused here (None): which of them gets ids of its
own depends on the Ray blocks (`requests._expand_records`). Cost: the expansion of every row once (1M requests
of 250k media: 4.2-4.6 s on one loaded core, `python -m benchmarks.bench_nothing_to_do`), 16 B per id kept.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from vlbatch.operators.errors import VlbatchError
from vlbatch.operators.sink.ids import KEY, IdIndex, id_keys
from vlbatch.operators.storage import replace_file
from vlbatch.pipeline.config import TaskSection
from vlbatch.pipeline.plan.fingerprint import FINGERPRINT_NAME, check_fingerprint
from vlbatch.pipeline.plan.sink import open_sink
from vlbatch.pipeline.plan.spec import RunPlan
from vlbatch.pipeline.sources.base import COLUMNS
from vlbatch.pipeline.stages.requests import clip_request_id, expand_rows
from vlbatch.pipeline.stages.rows import MediaTask
from vlbatch.pipeline.telemetry.summary import error_limits_text, past_error_limits

log = logging.getLogger("vlbatch.pipeline")


@dataclass(frozen=True)
class NothingToDo:
    """Every request of the input is committed under `run_uri`: `requests` distinct ids; `errors` of the
    `committed` rows are error rows (the run's verdict against `max_error_fraction`)."""

    run_uri: str
    requests: int
    errors: int
    committed: int
    max_error_fraction: float
    min_error_rows: int

    @property
    def error_fraction(self) -> float:
        return self.errors / self.committed if self.committed else 0.0

    @property
    def exit_code(self) -> int:
        """1 past both error limits (`telemetry/summary.past_error_limits`, what a rerun's summary says), else 0."""
        failed = past_error_limits(self.errors, self.error_fraction, self.max_error_fraction, self.min_error_rows)
        return 1 if failed else 0

    def line(self) -> str:
        """The run's one line; with error rows committed, which limit they passed and the verdict, as a run says."""
        line = f"[vlbatch] nothing to do: all {self.requests} requests of {self.run_uri.rstrip('/')}/ are committed"
        if self.errors:
            line += "; " + error_limits_text(self.errors, self.error_fraction, self.max_error_fraction,
                                             self.min_error_rows)
        return line


def block_rows(block: pa.Table, task: TaskSection) -> list[MediaTask]:
    """The expanded rows of one block of manifest rows (`sources/base.MANIFEST_SCHEMA`), in order, as
    `requests.expand_rows` gives them (every request, duplicates included; no kept-values re-keying)."""
    records = zip(*(block.column(c).to_pylist() for c in COLUMNS[:6]), strict=True)
    return [row for rec in records for row in expand_rows(*rec[:3], task, *rec[3:6])]


def block_ids(block: pa.Table, task: TaskSection) -> list[str]:
    """The request ids of one block of manifest rows, in order (`block_rows`)."""
    return [rid for row in block_rows(block, task) for rid in row.ids]


def clip_keys(rids: list[str], done: IdIndex, last: IdIndex) -> np.ndarray | None:
    """`[n] S16` the committed clip ids of the video requests `rids` when each one's clips 0, 1, ... are
    committed up to a clip marked last; None at the first video request with work left. Ends: each round
    needs every asked clip id in `done`, and a request's clip ids are distinct."""
    keys: list[np.ndarray] = []
    todo, k = list(rids), 0
    while todo:
        ks = id_keys([clip_request_id(r, k) for r in todo])
        if not done.contains_many(ks).all():
            return None
        keys.append(ks)
        todo = [r for r, end in zip(todo, last.contains_many(ks), strict=True) if not end]
        k += 1
    return np.concatenate(keys) if keys else np.zeros(0, KEY)


def _block_keys(block: pa.Table, task: TaskSection, done: IdIndex, last: IdIndex | None) -> np.ndarray | None:
    """`[n] S16` the committed ids of one block's requests (a clipped video's: its clips'), None: work left.
    `last`: the sink's `last_clip_ids` in a clipped run (None: no clips)."""
    if last is None:
        k = id_keys(block_ids(block, task))
        return k if done.contains_many(k).all() else None
    plain, videos = [], []
    for row in block_rows(block, task):  # as the CPU stage cuts: only an ok video row becomes clips
        (videos if row.status == "ok" and row.media_type == "video" else plain).extend(row.ids)
    whole = id_keys(videos)
    failed = done.contains_many(whole)  # the whole file failed: one row under the video's own id
    k = id_keys(plain)
    clips = clip_keys([r for r, f in zip(videos, failed, strict=True) if not f], done, last)
    if clips is None or not done.contains_many(k).all():
        return None
    return np.concatenate([k, whole[failed], clips])


def covered(blocks: Iterable[pa.Table], task: TaskSection, done: IdIndex, *, limit: int | None,
            keep: bool, last: IdIndex | None = None) -> int | None:
    """The distinct request ids of `blocks` (the first `limit` rows) when `done` holds them all (`last`: a
    clipped run's last-clip ids, `_block_keys`); None at the first block with a pending id, or (`keep`: kept
    columns) when an id occurs twice."""
    keys: list[np.ndarray] = []  # [n] S16 per block
    left = limit
    for block in blocks:
        if left is not None:
            block = block.slice(0, left)
            left -= block.num_rows
        k = _block_keys(block, task, done, last)
        if k is None:
            return None
        keys.append(k)
        if left == 0:
            break
    every = np.concatenate(keys) if keys else np.zeros(0, KEY)
    distinct = len(np.unique(every))
    return None if keep and distinct != len(every) else distinct


@dataclass(frozen=True)
class OpenedRun:
    """The run's sink and its committed index, read once before Ray starts (`open_run`) and handed to
    `pipeline/graph.run_job`; `idle`: the nothing-to-do verdict (None: work). `sink` None: it could not be
    opened or read here (a storage failure): the run meets that where it always did."""

    sink: object
    index: object
    idle: NothingToDo | None


def open_run(plan: RunPlan) -> OpenedRun:
    """The run's sink opened and its committed index read, once (`jobs/local.py`, before Ray starts), then the
    module docstring's decision on them. Read only: a run with work prepares its sink in `run_job`."""
    try:
        sink = open_sink(plan.cfg, plan.run.run_uri, plan.run.storage, plan.source)
        index = sink.index(max_tokens=plan.cfg.sampling.max_tokens)  # TruncatedError rows it would redo: work
    except VlbatchError as e:  # StorageError after its retries: `run_job` opens the sink and meets it there
        log.debug("rerun check skipped: %s", e)
        return OpenedRun(None, None, None)
    note = plan.run.fingerprint
    if note is not None and note.missing and index.files:
        log.warning("run %s holds rows but no %s (made before fingerprints): its config is taken as this one",
                    plan.run.run_id, FINGERPRINT_NAME)
    return OpenedRun(sink, index, nothing_to_do(plan, sink, index))


def nothing_to_do(plan: RunPlan, sink=None, index=None) -> NothingToDo | None:
    """The module docstring's decision, for the checked `plan` (`plan/preflight.py`), in the driver (`sink` and
    its `index`: `open_run`'s; None: read here). A storage or input failure on the way is None: the run then
    meets it where it always did (one line, `jobs/failures.py`)."""
    try:
        return _decide(plan, sink, index)
    except VlbatchError as e:  # StorageError after its retries, a manifest the tasks would fail on
        log.debug("rerun check skipped: %s", e)
        return None


def _decide(plan: RunPlan, sink, index) -> NothingToDo | None:
    cfg = plan.cfg
    if not cfg.resume.enabled:  # committed files then are refused by `run_job`, as before
        return None
    if sink is None:
        sink = open_sink(cfg, plan.run.run_uri, plan.run.storage, plan.source)
        # read only: a run with work prepares its sink in `run_job`, as before; TruncatedError rows cut at fewer
        # tokens than this run's max_tokens count as transient (redone: work), as `run_job` counts them
        index = sink.index(max_tokens=cfg.sampling.max_tokens)
    if not len(index.done_ids) or index.duplicate_ids or (cfg.resume.retry_transient and len(index.purgeable_ids)):
        return None  # a fresh run; or a run to tidy: ids committed twice, transient rows to purge and redo
    blocks = plan.source.driver_blocks()  # the input read in the driver only when rows are committed
    if blocks is None:
        return None
    done = index.done_ids if cfg.resume.retry_transient else index.done_ids | index.transient_ids
    last = index.last_clip_ids if cfg.video.clips.mode != "none" else None
    n = covered(blocks, cfg.task, done, limit=cfg.input.limit, keep=bool(cfg.input.columns.keep), last=last)
    if n is None:
        return None
    note = plan.run.fingerprint  # an accepted config change is recorded, as a run records it
    if note is None:
        note = check_fingerprint(cfg, plan.run.run_id, plan.run.storage)
    replace_file(note.uri, note.data, plan.run.storage)
    counts = index.status_counts
    return NothingToDo(sink.uri, n, counts.get("error", 0), sum(counts.values()), cfg.max_error_fraction,
                       cfg.min_error_rows)
