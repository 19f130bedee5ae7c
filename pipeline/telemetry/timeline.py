"""`Timeline`: the run's throughput over time, from the write stage's stats rows.

The driver feeds every stats block to `update` as it arrives (beside `Progress`); rows and
tokens are added to the time bucket of their arrival (`bucket_s` wide, counted from the graph's
start). At most `max_points` buckets are kept: past that the width doubles and neighbouring
buckets merge, so a run of days still writes a few KiB. `to_json()` goes into the run's
`_summary.json` (`RunSummary.timeline`), where `vlbatch inspect` plots rows/s and tokens/s.
A resumed run's summary holds the timeline of its last call only.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

# per bucket, in this order: rows, error rows, prompt / visual / generated tokens
FIELDS = ("rows", "errors", "prompt_tokens", "visual_tokens", "generated_tokens")


@dataclass
class Timeline:
    bucket_s: float = 1.0
    max_points: int = 240
    clock: Callable[[], float] = time.monotonic
    buckets: list[list[int]] = field(default_factory=list)  # [B, len(FIELDS)]

    def __post_init__(self):
        self.start = self.clock()
        self.started_at = time.time()  # wall clock of the start (unix seconds), for the reader

    def update(self, stats: pa.Table) -> None:
        """One stats block (`write_stage.STATS_SCHEMA` columns) arrived now."""
        k = int((self.clock() - self.start) // self.bucket_s)
        while k >= self.max_points:
            self._coarsen()
            k //= 2
        while len(self.buckets) <= k:
            self.buckets.append([0] * len(FIELDS))
        d = stats.to_pydict()
        errors = sum(s == "error" for s in d["status"])
        sums = [sum(x or 0 for x in d[name]) for name in FIELDS[2:]]
        for i, v in enumerate([stats.num_rows, errors, *sums]):
            self.buckets[k][i] += int(v)

    def _coarsen(self) -> None:
        """Twice the width: bucket pairs (2i, 2i + 1) merge."""
        b = self.buckets
        self.buckets = [[x + y for x, y in zip(b[i], b[i + 1] if i + 1 < len(b) else [0] * len(FIELDS),
                                               strict=True)] for i in range(0, len(b), 2)]
        self.bucket_s *= 2

    def to_json(self) -> dict:
        """{"bucket_s", "started_at", "fields", "buckets": [[rows, errors, prompt, visual, generated], ...]}:
        bucket i covers [i * bucket_s, (i + 1) * bucket_s) seconds after the start."""
        return {"bucket_s": self.bucket_s, "started_at": round(self.started_at, 3), "fields": list(FIELDS),
                "buckets": [list(b) for b in self.buckets]}
