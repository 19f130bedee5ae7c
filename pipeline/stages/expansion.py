"""Manifest rows -> pending `MediaTask` rows, as Ray Data tasks, and what counts them.

`expanded(source, done)` is the lazy dataset of the read + expansion (`requests.expand_all` per
block: one request per question, committed ids dropped, identical requests of a block once);
`count_pending` counts a materialised one (a resumed run); on a fresh run the tasks tell a
`Tally` actor their counts as they go, so the ETA's total never needs a second read of the
manifest. The graph (`pipeline/graph.py`) decides which of the two a run uses; the streamed read's
CPUs and concurrency are the plan's (`plan/spec.read_spec`).
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.stages.requests import expand_all
from vlbatch.pipeline.stages.rows import MediaTask, to_table

DUPLICATES_COLUMN = "duplicates_dropped"  # per expanded block: identical requests dropped, on its first row


def expand_batch(batch: pa.Table, *, cfg: JobConfig, done, tally=None) -> pa.Table:
    """One manifest block -> its pending MediaTask rows, identical requests once (the ids of one
    block are remembered, so memory is bounded by the block); `duplicates_dropped` (an extra
    column the stages ignore) holds the count on the first row, for `count_pending`.
    `done`: the committed ids (`IdIndex`, or the `ObjectRef` of one: every task on a node maps
    the same object-store copy, zero-copy); `tally`: a `Tally` actor told the block's counts."""
    import ray

    from vlbatch.pipeline.sources.base import COLUMNS

    if isinstance(done, ray.ObjectRef):
        done = ray.get(done)
    records = zip(*(batch.column(c).to_pylist() for c in COLUMNS), strict=True)
    rows, dropped = expand_all(records, cfg.task, done)
    if tally is not None:
        tally.add.remote(batch.num_rows, sum(len(r.ids) for r in rows), dropped)
    table = to_table(rows, MediaTask)
    counts = [dropped] + [0] * (len(rows) - 1) if rows else []
    return table.append_column(DUPLICATES_COLUMN, pa.array(counts, pa.int64()))



def expanded(source, done, num_cpus: float | None = None, concurrency: int | None = None, tally=None):
    """The lazy dataset of pending MediaTask rows of `source` (the run's `Source`: its manifest read
    + expansion, committed ids dropped; `done`: an `IdIndex` or its ObjectRef, see `expand_batch`)."""
    import ray

    return source.read(num_cpus=num_cpus, concurrency=concurrency).map_batches(
        expand_batch, batch_format="pyarrow", batch_size=None, num_cpus=num_cpus,
        compute=ray.data.TaskPoolStrategy(size=concurrency),  # at most `concurrency` tasks (None: Ray's choice)
        fn_kwargs={"cfg": source.cfg, "done": done, "tally": tally})


def count_pending(tasks_ds) -> tuple[int, int]:
    """(requests, duplicate requests dropped) of a dataset of expanded MediaTask rows."""
    requests = dropped = 0
    for b in tasks_ds.iter_batches(batch_format="pyarrow", batch_size=4096):
        requests += int(pc.sum(pc.list_value_length(b["ids"])).as_py() or 0)
        dropped += int(pc.sum(b[DUPLICATES_COLUMN]).as_py() or 0)
    return requests, dropped


class Tally:
    """Ray actor: the expansion tasks' counts (media rows read, requests expanded, duplicates
    dropped), summed as the blocks are expanded, so a fresh run needs no second read of the
    manifest for its total (the ETA) or its duplicate count."""

    def __init__(self):
        self.media = self.requests = self.dropped = 0

    def add(self, media: int, requests: int, dropped: int) -> None:
        self.media, self.requests, self.dropped = self.media + media, self.requests + requests, self.dropped + dropped

    def get(self) -> tuple[int, int, int]:
        return self.media, self.requests, self.dropped
