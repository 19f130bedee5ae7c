"""`Timeline`: the run's throughput over time, from the write stage's stats rows.

The driver feeds every stats block to `update` as it arrives (beside `Progress`); rows and
tokens are added to the time bucket of their arrival (`bucket_s` wide, counted from the graph's
start). At most `max_points` buckets are kept: past that the width doubles and neighbouring
buckets merge, so a run of days still writes a few KiB. `to_json()` goes into the run's
`_summary.json` (`RunSummary.timeline`), where `vlbatch inspect` plots rows/s and tokens/s.
A resumed run's summary holds the timeline of its last call only. The progress ticker adds the
model actors' engine-stepping and waiting milliseconds as they grow (`observe_model`), so each
bucket also says how busy the model stage was then (busy / (busy + wait)).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

# per bucket, in this order: rows, error rows, prompt / visual / generated tokens (from the stats rows),
# then the model actors' summed engine-stepping and waiting (input + output) milliseconds
TOKEN_FIELDS = ("prompt_tokens", "visual_tokens", "generated_tokens")
FIELDS = ("rows", "errors", *TOKEN_FIELDS, "model_busy_ms", "model_wait_ms")


@dataclass
class Timeline:
    bucket_s: float = 1.0
    max_points: int = 240
    clock: Callable[[], float] = time.monotonic
    buckets: list[list[int]] = field(default_factory=list)  # [B, len(FIELDS)]

    def __post_init__(self):
        self._model_ms = (0, 0)  # busy, wait ms observed so far
        self._lock = threading.Lock()  # `update` (the graph's iterator) and `observe_model` (the ticker)
        self.start = self.clock()
        self.started_at = time.time()  # wall clock of the start (unix seconds), for the reader

    def _bucket(self) -> list[int]:
        """The bucket of now (coarsening past `max_points`)."""
        k = int((self.clock() - self.start) // self.bucket_s)
        while k >= self.max_points:
            self._coarsen()
            k //= 2
        while len(self.buckets) <= k:
            self.buckets.append([0] * len(FIELDS))
        return self.buckets[k]

    def update(self, stats: pa.Table) -> None:
        """One stats block (`write_stage.STATS_SCHEMA` columns) arrived now."""
        d = stats.to_pydict()
        errors = sum(s == "error" for s in d["status"])
        sums = [sum(x or 0 for x in d[name]) for name in TOKEN_FIELDS]
        with self._lock:
            bucket = self._bucket()
            for i, v in enumerate([stats.num_rows, errors, *sums]):
                bucket[i] += int(v)

    def settle(self, rows: int, errors: int) -> None:
        """A stopped call's committed `rows` (`errors` of them error rows): those no stats block brought (the
        writers' batches published by the stop's tidy-up) go to the bucket of now, when they were published."""
        with self._lock:
            seen, seen_errors = (sum(b[i] for b in self.buckets) for i in (0, 1))
            if rows > seen:
                bucket = self._bucket()
                bucket[0] += rows - seen
                bucket[1] += max(0, errors - seen_errors)

    def observe_model(self, busy_s: float, wait_s: float) -> None:
        """The model actors' cumulative stepping and waiting seconds now: their growth goes to this bucket."""
        ms = (int(busy_s * 1000), int(wait_s * 1000))
        with self._lock:
            grown = [max(0, now - before) for now, before in zip(ms, self._model_ms, strict=True)]
            self._model_ms = ms
            if not any(grown):
                return
            bucket = self._bucket()
            bucket[-2] += grown[0]
            bucket[-1] += grown[1]

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


def _valid(t) -> bool:
    """A `Timeline.to_json()` dict this code can merge (the file is read, not trusted)."""
    if not isinstance(t, dict) or t.get("fields") != list(FIELDS) or not isinstance(t.get("buckets"), list):
        return False
    w = t.get("bucket_s")
    return (isinstance(w, int | float) and not isinstance(w, bool) and 0 < w < 1e9
            and all(isinstance(b, list) and len(b) == len(FIELDS) for b in t["buckets"]))


def _widened(buckets: list[list[int]], factor: int) -> list[list[int]]:
    """Buckets merged `factor` at a time (a wider width)."""
    return [[sum(col) for col in zip(*buckets[i:i + factor], strict=True)] for i in range(0, len(buckets), factor)]


def concat(first: dict | None, then: dict | None, max_points: int = 240) -> dict:
    """Two timelines (`Timeline.to_json()` dicts) as one: `then`'s buckets after `first`'s (a run's attempts one
    after another, the time between them left out), at the wider of the two widths (the other's buckets merged
    into it), the width doubled while past `max_points`. One that is not a timeline (missing, older fields) is
    left out; neither: {}."""
    parts = [t for t in (first, then) if _valid(t)]
    if not parts:
        return {}
    width = max(t["bucket_s"] for t in parts)
    buckets: list[list[int]] = []
    for t in parts:
        buckets += _widened([list(b) for b in t["buckets"]], max(1, round(width / t["bucket_s"])))
    while len(buckets) > max_points:
        buckets, width = _widened(buckets, 2), width * 2
    return {"bucket_s": width, "started_at": parts[0].get("started_at"), "fields": list(FIELDS), "buckets": buckets}
