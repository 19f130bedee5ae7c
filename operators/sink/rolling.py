"""`PartRoller`: one writer's rolling part files on the `Sink` contract (stage / commit / unstage).

The exactly-once design is in `sink/parquet.py` (module docstring). Per `add(batch)`:
1. the batches held (all from earlier calls, whose calls have returned) are published as one
   part when they reach the size target or the oldest is `interval_s` old;
2. the batch is staged (durable, invisible);
3. a batch that alone reaches the target is published alone (its name is the hash of its
   ids, so a retry of it lands on the same name); any other batch is held.
`publish_due()` publishes the held batches once the oldest is `interval_s` old, between calls: a
writer that gets no next batch (the model still generating, the rows spread over several writers)
still publishes every `interval_s`. `PublishTimer` calls it from a thread of the writer's own
(`pipeline/stages/write_stage.py`), so the interval holds whether or not a call comes; the roller
is thread-safe for that.
`flush()` publishes what is held (tests; the runner's end-of-run path is `Sink.seal`, since a
Ray Data actor is not told that its stream ended).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pyarrow as pa

from vlbatch.operators.sink.base import Sink


@dataclass(frozen=True)
class RollPolicy:
    """When a writer publishes: `target_bytes` (Arrow bytes held; the zstd file is smaller) or
    `target_rows` (either reached), or the oldest held batch is `interval_s` old."""

    target_bytes: int | None = 32 << 20
    target_rows: int | None = None
    interval_s: float = 120.0

    def full(self, rows: int, nbytes: int) -> bool:
        return bool((self.target_rows and rows >= self.target_rows) or
                    (self.target_bytes and nbytes >= self.target_bytes))


class PartRoller:
    """One writer's open part (`group`: the writer's folder name, unique per writer)."""

    def __init__(self, sink: Sink, policy: RollPolicy, group: str, clock=time.monotonic):
        self.sink, self.policy, self.group, self.clock = sink, policy, group, clock
        self._held: list[tuple[str, pa.Table]] = []  # (staged name, rows)
        self._opened: float | None = None
        self._rows = self._bytes = 0
        self._lock = threading.RLock()  # `add` (the writer's call) and `publish_due` (its timer thread)

    def add(self, table: pa.Table) -> list[str]:
        """Take one batch (OUTPUT_SCHEMA rows); the names of the parts published by this call."""
        with self._lock:
            out = self.flush() if self._held and self.policy.full(self._rows, self._bytes) else self.publish_due()
            return out + self._take(table)

    def due_in(self) -> float | None:
        """Seconds until the held batches are due (0: now; None: nothing held)."""
        with self._lock:
            return None if not self._held else max(0.0, self._opened + self.policy.interval_s - self.clock())

    def publish_due(self) -> list[str]:
        """Publish the held batches if the oldest is `interval_s` old; the parts published."""
        with self._lock:
            return self.flush() if self.due_in() == 0.0 else []

    def _take(self, table: pa.Table) -> list[str]:
        out = []
        name = self.sink.stage(table, self.group)
        if name is None:
            return out
        if self.policy.full(table.num_rows, table.nbytes):  # alone: a deterministic name for its retry
            out += self.flush()
            out.append(self.sink.commit(table))
            self.sink.unstage(self.group, [name])
            return out
        if not self._held:
            self._opened = self.clock()
        self._held.append((name, table))
        self._rows += table.num_rows
        self._bytes += table.nbytes
        return out

    def flush(self) -> list[str]:
        """Publish the held batches as one part (nothing when none is held)."""
        with self._lock:
            if not self._held:
                return []
            names, tables = zip(*self._held, strict=True)
            part = self.sink.commit(pa.concat_tables(tables))
            self.sink.unstage(self.group, names)
            self._held, self._opened, self._rows, self._bytes = [], None, 0, 0
            return [part]

    @property
    def held_rows(self) -> int:
        """Rows held now (a publish in progress on the timer's thread: after it)."""
        with self._lock:
            return self._rows


class PublishTimer:
    """A writer's thread that publishes its roller's held batches when due (`PartRoller.publish_due`),
    calls or not. A publish that fails (storage, after its retries) is kept and raised by `check()`,
    which the writer calls at the start of each call: the batches stay staged, and the run stops with
    that error as it would have in a call. `close()` stops the thread."""

    def __init__(self, roller: PartRoller, poll_s: float = 1.0):
        self.roller, self.poll_s = roller, poll_s
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlbatch-publish", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.error is None:
            due = self.roller.due_in()
            if self._stop.wait(self.poll_s if due is None else min(self.poll_s, due)):
                return
            try:
                self.roller.publish_due()
            except Exception as e:  # noqa: BLE001 - raised in the writer's next call (`check`)
                self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
