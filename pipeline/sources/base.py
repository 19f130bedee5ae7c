"""The input source contract: where a job's media rows come from.

A `Source` turns the job's `input` section into a lazy Ray dataset of *manifest rows*, one per
media, with exactly the columns of `MANIFEST_SCHEMA`:
- `media_uri` (string, may be null or "": expansion makes that an `InputError` row), the
  media's identity in the output and, for sources that do not carry bytes, where the
  decode stage reads them from (through `vlbatch.operators.storage`);
- `media_type` ("image" / "video", or null: from the extension, then the bytes' signature);
- `questions` (list<string> or null: `task.questions` then apply);
- `media_bytes` (large_binary or null): the media's bytes when the input carries them
  (WebDataset members, embedded Parquet bytes); the decode stage then reads nothing;
- `identity` (string or null): what request ids hash instead of `media_uri` (a WebDataset
  sample key); null: the `media_uri`;
- `error` (string or null): the source could not produce this media (a truncated shard, a
  corrupt tar member): the row becomes an `InputError` row with this message;
- `keep` (large_binary or null): the `input.columns.keep` values of the row (`pipeline/sources/keep.py`),
  cast to `keep_schema()`.

Rules every source keeps:
- `read` never reads the whole input into the driver: listing happens in the driver, reading
  in Ray tasks of `num_cpus` CPUs each (fractional: they run beside actor pools holding the
  other CPUs; a 1-CPU read task there would never start), at most `concurrency` at once.
- Bad input that is not the source's own structure (a missing column, an unreadable file)
  raises `ConfigError` naming the field before work starts where it can be seen from the
  driver, else `InputError` in the task.
- `input.limit` is applied by the source (the first N rows in the source's order).
- `keep_schema()` is the Arrow schema of `input.columns.keep`, fixed for the run from the
  input's schema (None when nothing is kept); cheap (file metadata), called by the driver
  and every write actor.
- `count()` is the number of rows when the source knows it without reading the rows
  (file metadata), else None (the runner then counts beside the run for the ETA); `counted_by()`
  says how (`vlbatch validate`'s input line).
- `check()` (the preflight's input step) refuses a configured column the input's schema lacks,
  naming the field and the columns there are, from bounded reads only (a Parquet footer, a text
  manifest's first lines, a shard's first sample), so a typo is no run of error rows.
- `driver_blocks()` is the manifest rows read in this process, without Ray, when that is cheap (a local
  manifest of URIs, a glob's listing): the blocks `read` gives, in its order, `input.limit` not applied;
  else None (`pipeline/startup/nothing_to_do.py`: a rerun with nothing left starts no Ray).
- `embeds_media()` says whether rows carry their media's bytes (`media_bytes`), from metadata
  at most (a Parquet footer): scan mode then keeps the configured batch size, since a batch of
  rows holds all its media's bytes (`pipeline/plan/spec.py:scan_batch_size`).

A new input format is one new module here with a `Source` subclass (built as `cls(cfg, storage)`), and
one `Entry` in `SOURCES` (`pipeline/config/formats.py`): `input.format` then accepts its name.
"""
from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import ray

from vlbatch.operators.storage import StorageOptions
from vlbatch.pipeline.config import JobConfig

MANIFEST_SCHEMA = pa.schema([("media_uri", pa.string()), ("media_type", pa.string()),
                             ("questions", pa.list_(pa.string())), ("media_bytes", pa.large_binary()),
                             ("identity", pa.string()), ("error", pa.string()), ("keep", pa.large_binary())])
COLUMNS = tuple(MANIFEST_SCHEMA.names)


class Source:
    """One input format; see the module docstring for the contract."""

    def __init__(self, cfg: JobConfig, storage: StorageOptions | None = None):
        self.cfg = cfg
        # the run's `StorageOptions`, made once by the preflight (`RunPlan.storage`); None: made here
        self.storage = cfg.storage.options() if storage is None else storage

    def read(self, *, num_cpus: float | None = None, concurrency: int | None = None) -> ray.data.Dataset:
        """The manifest rows as a lazy Ray dataset (columns `COLUMNS`)."""
        raise NotImplementedError

    def keep_schema(self) -> pa.Schema | None:
        """The schema of `input.columns.keep` (None: nothing kept)."""
        if self.cfg.input.columns.keep:
            from vlbatch.operators.errors import ConfigError

            raise ConfigError(f"input.columns.keep: input.format={self.cfg.input.format} has no columns to keep")
        return None

    def check(self) -> None:
        """`ConfigError` naming a configured column the input does not have (bounded reads only)."""
        self.keep_schema()

    def count(self) -> int | None:
        """Rows, when known without reading them; None otherwise."""
        return None

    def counted_by(self) -> str:
        """How `count()` knows the rows, when it does ('parquet metadata', 'glob listing')."""
        return "listing"

    def driver_blocks(self) -> Iterator[pa.Table] | None:
        """The manifest rows read here, without Ray, when cheap (module docstring); None: not offered."""
        return None

    def embeds_media(self) -> bool:
        """Whether rows carry the media's bytes (not URIs): then a batch of rows holds its media
        in memory, and scan mode keeps small batches (`plan/spec.scan_batch_size`)."""
        return False


def task_pool(size: int | None):
    """The compute strategy of a function stage: at most `size` tasks at once (None: Ray Data's choice)."""
    return ray.data.TaskPoolStrategy(size=size)


def manifest_table(n: int, **cols) -> pa.Table:
    """A block of `n` manifest rows: the given columns (lists or arrays), null for the rest."""
    return pa.table({f.name: pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(n, f.type)
                     for f in MANIFEST_SCHEMA}, schema=MANIFEST_SCHEMA)


def limit(ds: ray.data.Dataset, n: int | None) -> ray.data.Dataset:
    return ds if n is None else ds.limit(n)
