"""`vlbatch export RUN --layout media|rows --format parquet|jsonl|csv -o DEST`: a run's rows as a file.

RUN is what `vlbatch inspect` takes (`jobs/inspect/run.resolve_run`: a run folder, local or s3://, or a
job config). Layouts:
- `rows`: one line per request, the run's columns (OUTPUT_SCHEMA, then its kept input columns; a part
  written before a column existed: null there), converted part by part (memory: one part).
- `media`: one row per media (per clip), each prompt its own typed column (`jobs/export/media.py`: the
  columns, the key, the two passes that bound memory). The prompts' formats come from the task config:
  the run's `_fingerprint.json` (it records every `task.*` field), else RUN given as a job config, else
  `--config JOB.yaml`; with both, they must agree (a different task would type the columns wrongly).
How nested values look in JSONL and CSV, and how DEST is written whole or not at all (local or s3://):
`jobs/export/write.py`. DEST must lie outside the run folder.

What is read, in both layouts (`jobs/export/parts.py` checks it; docs/troubleshooting.md says it for users):
- the run's parts are the files the sink commits, `part-<24 hex>.parquet` in the run folder
  (`ParquetSink.parts`); any other file there (a foreign Parquet file, `part-x.parquet`, `_clips/`) is ignored;
- a part that is not Parquet, lacks a column every part has (`id`, `status`, `request_index`, `prompt`, ...) or
  holds a null there, has an `id` / `status` that is not text, or a value that does not cast to the run's column
  type: one line naming the file (and the column), exit 1, nothing written;
- ids are unique in every export: a row whose id an earlier row holds is dropped, by the rule the run's own
  seal keeps (`sink/dedupe.py`: a done row before a transient error row, then the first part in name order,
  then the first row), so a copied part or an unsealed run's copies count once;
- a `parsed` value that is not JSON text: one line naming the file and the row's id, exit 1, nothing written.
"""
from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from vlbatch.jobs.export.media import (
    DEFAULT_BUCKET_ROWS,
    READ_COLUMNS,
    MediaSpec,
    bucket_tables,
    make_spec,
    media_count,
    named,
    pivot,
)
from vlbatch.jobs.export.parts import BadPart, RunParts, read_part, scan_parts
from vlbatch.jobs.export.write import FORMATS, ExportFile
from vlbatch.jobs.inspect.run import RunRef, read_fingerprint, reading, resolve_run
from vlbatch.operators.errors import ConfigError, VlbatchError
from vlbatch.operators.sink.parquet import ParquetSink, release_arrow_memory
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA
from vlbatch.operators.storage import StorageOptions

LAYOUTS = ("media", "rows")


@dataclass(frozen=True)
class Exported:
    """What an export read and wrote: the run's request `rows`; for the media layout its distinct `media` and
    the `clips` among its rows (a media row is a media, or one clip of a clipped video); None: rows layout."""

    rows: int
    media: int | None = None
    clips: int = 0

    def text(self) -> str:
        """'16 rows (13 media, 16 clips)', '13 rows (6 media)', '13 rows'."""
        rows = f"{self.rows} row{'' if self.rows == 1 else 's'}"
        if self.media is None:
            return rows
        clips = f", {self.clips} clip{'' if self.clips == 1 else 's'}" if self.clips else ""
        return f"{rows} ({self.media} media{clips})"


def run_export(target: str, *, layout: str, fmt: str, dest: str, config: str | None = None,
               endpoint_url: str | None = None, bucket_rows: int = DEFAULT_BUCKET_ROWS,
               tmp_dir: str | None = None) -> int:
    """The command: exit 0 and one line `exported N rows (M media[, C clips]) to DEST`; 2 with one line on
    stderr for bad usage or a RUN that is not a run; 1 for a storage failure or a part that breaks the rules
    (module docstring)."""
    try:
        done = export(target, layout=layout, fmt=fmt, dest=dest, config=config, endpoint_url=endpoint_url,
                      bucket_rows=bucket_rows, tmp_dir=tmp_dir)
    except ConfigError as e:
        print(f"vlbatch export: {e}", file=sys.stderr)
        return 2
    except VlbatchError as e:
        print(f"vlbatch export: {e.error_type}: {e}", file=sys.stderr)
        return 1
    except BadPart as e:
        print(f"vlbatch export: nothing written to {dest}: {e}", file=sys.stderr)
        return 1
    except (pa.ArrowException, OSError) as e:  # a full disk: one line, DEST untouched
        from vlbatch.operators.storage.retry import describe

        print(f"vlbatch export: nothing written to {dest}: {describe(e)}", file=sys.stderr)
        return 1
    print(f"exported {done.text()} to {dest}")
    return 0


def export(target: str, *, layout: str, fmt: str, dest: str, config: str | None = None,
           endpoint_url: str | None = None, bucket_rows: int = DEFAULT_BUCKET_ROWS,
           tmp_dir: str | None = None) -> Exported:
    """Export (module docstring) -> what was read and written (`Exported`)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"--layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if bucket_rows < 1:
        raise ConfigError(f"--bucket-rows must be 1 or more, got {bucket_rows}")
    ref = resolve_run(target, endpoint_url)
    _check_dest(dest, ref)
    sink = ParquetSink(ref.uri, ref.storage)
    parts = scan_parts(sink, reading(ref.uri, ref.storage, sink.parts))
    schema, total = parts.schema, parts.rows
    storage = _dest_storage(dest, ref, endpoint_url)
    if layout == "rows":
        _write(dest, fmt, schema, storage, _rows(sink, parts))
        return Exported(total)
    keep = pa.schema([f for f in schema if f.name not in OUTPUT_SCHEMA.names])
    task = run_task(ref, target, config)
    with tempfile.TemporaryDirectory(prefix="vlbatch-export-", dir=tmp_dir) as folder:
        seen: set[str] = set()
        caption_mode = task.mode == "caption"
        columns = [*READ_COLUMNS, *keep.names]  # only what the layout reads
        tables = (_seen(named(read_part(sink, parts, p, columns), caption_mode, keep), seen) for p in parts.paths)
        buckets = bucket_tables(tables, total, bucket_rows, folder)
        first = next(buckets, None)  # pass 1 is done once the first bucket comes: every name is seen
        spec = make_spec(task, seen, keep)
        counts = [0, 0]
        _write(dest, fmt, spec.schema(), storage, _media(first, buckets, spec, counts))
    return Exported(total, counts[0], counts[1])


def _seen(table: pa.Table, seen: set[str]) -> pa.Table:
    from vlbatch.jobs.export.media import NAME

    seen.update(n for n in table[NAME].unique().to_pylist() if n is not None)
    release_arrow_memory()
    return table


def _media(first, buckets, spec: MediaSpec, count: list[int]) -> Iterator[pa.Table]:
    for bucket in ([first] if first is not None else []):
        yield _counted(pivot(bucket, spec), spec, count)
    for bucket in buckets:
        yield _counted(pivot(bucket, spec), spec, count)
        release_arrow_memory()


def _counted(table: pa.Table, spec: MediaSpec, counts: list[int]) -> pa.Table:
    """`table` (one bucket's media rows), its media and clips added to `counts`."""
    media, clips = media_count(table, spec.keep)
    counts[0] += media
    counts[1] += clips
    return table


def _rows(sink: ParquetSink, parts: RunParts) -> Iterator[pa.Table]:
    schema = parts.schema
    for p in parts.paths:
        t = read_part(sink, parts, p)
        missing = [f for f in schema if f.name not in t.column_names]
        for f in missing:  # a part from before the column existed
            t = t.append_column(f, pa.nulls(t.num_rows, f.type))
        yield t.select(schema.names).cast(schema)
        release_arrow_memory()


def _write(dest: str, fmt: str, schema: pa.Schema, storage: StorageOptions, tables) -> None:
    out = ExportFile(dest, fmt, schema, storage)
    try:
        for t in tables:
            out.write(t)
    except BaseException:
        out.abort()
        raise
    try:
        out.commit()
    except OSError as e:
        out.abort()
        raise ConfigError(f"-o {dest}: cannot write it: {e}") from e


def _check_dest(dest: str, ref: RunRef) -> None:
    from vlbatch.operators.storage.options import output_uri_problem

    problem = output_uri_problem(dest)
    if problem:
        raise ConfigError(f"-o {dest}: {problem}")
    run = _norm(ref.uri)
    if _norm(dest) == run or _norm(dest).startswith(run + "/"):
        raise ConfigError(f"-o {dest}: inside the run folder {ref.uri}; write the export elsewhere (the run's "
                          "readers take every part file there as its rows)")
    if not dest.startswith(("s3://", "s3a://")) and os.path.isdir(dest):
        raise ConfigError(f"-o {dest}: is a folder; name the file to write (e.g. {dest.rstrip('/')}/export.parquet)")


def _norm(uri: str) -> str:
    if uri.startswith(("s3://", "s3a://")):
        return "s3://" + uri.split("://", 1)[1].rstrip("/")
    return os.path.abspath(uri.removeprefix("file://")).rstrip("/")


def _dest_storage(dest: str, ref: RunRef, endpoint_url: str | None) -> StorageOptions:
    """DEST's storage: the run's (its endpoint) when DEST is on S3 too."""
    if dest.startswith(("s3://", "s3a://")):
        return ref.storage if ref.uri.startswith(("s3://", "s3a://")) or not endpoint_url else \
            StorageOptions(endpoint_url=endpoint_url)
    return ref.storage


def run_task(ref: RunRef, target: str, config: str | None):
    """The task config the run's answers were made with (module docstring); ConfigError when unknown."""
    from vlbatch.pipeline.config import load_config
    from vlbatch.pipeline.plan.fingerprint import changed_fields, task_fields

    recorded = _recorded_flat(ref)
    given = None
    if config:
        try:
            given = load_config(config).task
        except ConfigError as e:
            raise ConfigError(f"--config {config}: {e}") from None
    elif ref.from_config:
        given = load_config(target).task
    if given is not None and recorded is not None:
        differ = changed_fields(recorded, task_fields(given.model_dump(mode="json")))
        if differ:
            raise ConfigError(f"--config {config or target}: its task differs from the run's ({', '.join(differ)}, "
                              f"recorded in {ref.uri}/_fingerprint.json); give the config the run was made with")
    if given is not None:
        return given
    if recorded is None:
        raise ConfigError(f"{ref.uri} records no task config (no _fingerprint.json): --layout media needs the "
                          "prompts' formats; pass --config JOB.yaml (the job config of the run)")
    return _task_of(recorded, ref)


def _recorded_flat(ref: RunRef) -> dict | None:
    """The fingerprint's `task.*` fields as `fingerprint.task_fields` makes them (a fingerprint written before
    `answer_fields` holds a `schema_file` beside its schema too), None when it records none."""
    from vlbatch.pipeline.plan.fingerprint import answer_fields

    flat = (read_fingerprint(ref) or {}).get("fingerprint")
    if not isinstance(flat, dict):
        return None
    task = {k: v for k, v in flat.items() if k.startswith("task.")}
    return answer_fields(task) or None


def _task_of(flat: dict, ref: RunRef):
    """The fingerprint's flattened `task.*` fields (`task.response_format.schema.type`) as a TaskSection
    (a caption schema whose property names hold a '.' does not unflatten: pass --config)."""
    from pydantic import ValidationError

    from vlbatch.pipeline.config import TaskSection

    data: dict = {}
    for key, value in flat.items():
        *path, last = key.split(".")[1:]
        node = data
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    try:
        return TaskSection.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{ref.uri}/_fingerprint.json: its task fields do not read as a task config "
                          f"({e.errors()[0]['msg']}); pass --config JOB.yaml") from None
