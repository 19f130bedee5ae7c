"""`PartRoller`: one writer's rolling part files on the `Sink` contract (stage / commit / unstage).

The exactly-once design is in `sink/parquet.py` (module docstring). Per `add(batch)`:
1. the batches held (all from earlier calls, whose calls have returned) are published as one
   part when they reach the size target or the oldest is `interval_s` old;
2. the batch is staged (durable, invisible);
3. a batch that alone reaches the target is published alone (its name is the hash of its
   ids, so a retry of it lands on the same name); any other batch is held.
`flush()` publishes what is held (tests; the runner's end-of-run path is `Sink.seal`, since a
Ray Data actor is not told that its stream ended).
"""
from __future__ import annotations

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

    def add(self, table: pa.Table) -> list[str]:
        """Take one batch (OUTPUT_SCHEMA rows); the names of the parts published by this call."""
        out = []
        if self._held and (self.policy.full(self._rows, self._bytes)
                           or self.clock() - self._opened >= self.policy.interval_s):
            out += self.flush()
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
        if not self._held:
            return []
        names, tables = zip(*self._held, strict=True)
        part = self.sink.commit(pa.concat_tables(tables))
        self.sink.unstage(self.group, names)
        self._held, self._opened, self._rows, self._bytes = [], None, 0, 0
        return [part]

    @property
    def held_rows(self) -> int:
        return self._rows
