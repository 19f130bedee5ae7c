"""The write stage: Generated rows -> rolling part files on the run's sink.

Runs as a Ray actor pool (`WriteStage`, `resources.write`: min..max actors, so writers scale
with throughput). Each call explodes its media rows into one `OutputRow` per request,
hands them to the actor's `PartRoller` (`vlbatch.operators.sink.rolling`: staged durably at
once, published in parts of `output.part_mb` / `output.part_rows`, at least every
`output.commit_interval_s`; the exactly-once design is in `vlbatch.operators.sink.parquet`) and
returns a small stats table, one row per request, that the driver aggregates for progress
and the run summary. The rows are staged (durable, published by the writer or by the
runner's `sink.seal()` at the end) before the stats row exists.

A commit that fails after all storage retries raises `StorageError` and the job stops with
that error; a rerun commits the rows (resume). A write actor that dies is restarted by Ray
Data and its batch retried with the same rows, which the sink commits once.
"""
from __future__ import annotations

import pyarrow as pa

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.sink import OUTPUT_SCHEMA, OutputRow, ParquetSink, Sink, Timings, rows_to_table
from vlbatch.operators.sink.rolling import PartRoller
from vlbatch.operators.storage import bucket_exists, filesystem, is_object_store
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.keep import decode as decode_keep
from vlbatch.pipeline.keep import output_schema
from vlbatch.pipeline.rows import Generated, from_table

STATS_SCHEMA = pa.schema([
    ("id", pa.string()), ("status", pa.string()), ("error_type", pa.string()), ("prompt_tokens", pa.int64()),
    ("visual_tokens", pa.int64()), ("generated_tokens", pa.int64()), ("cached_tokens", pa.int64()),
    ("vision_hits", pa.int64()), ("vision_encodes", pa.int64()), ("decode_s", pa.float64()),
    ("preprocess_s", pa.float64()), ("model_s", pa.float64()), ("model_cpu_s", pa.float64()), ("file", pa.string()),
])


def output_rows(g: Generated, model: str, run_id: str) -> list[OutputRow]:
    """One media row -> one OutputRow per request (same fixed schema for ok and error)."""
    out = []
    timings = Timings(decode_s=g.decode_s, preprocess_s=g.preprocess_s, model_s=g.model_s)
    for i, rid in enumerate(g.ids):
        ok = g.statuses[i] == "ok"
        out.append(OutputRow(
            id=rid, request_index=g.request_indices[i], media_uri=g.media_uri, media_type=g.media_type,
            prompt=g.prompts[i], status="ok" if ok else "error", model=model, run_id=run_id,
            answer=g.answers[i] if ok else None, thinking=g.thinking[i] if ok else None,
            error_type=None if ok else g.req_error_types[i], error_message=None if ok else g.req_error_messages[i],
            prompt_tokens=g.prompt_tokens[i], visual_tokens=g.visual_tokens or None,
            generated_tokens=g.generated_tokens[i], finish_reason=g.finish_reasons[i], timings=timings))
    return out


def check_output(cfg: JobConfig) -> None:
    """Before any work: the bucket of an object-store `output.uri` must exist (`ConfigError`
    naming output.uri otherwise). Nothing ever creates a bucket: a typo in output.uri must not
    make a new one. An unreachable endpoint is `StorageError` after the retries."""
    storage = cfg.storage.options()
    fs, path = filesystem(cfg.output.uri, storage)
    if not is_object_store(fs):
        return
    bucket = path.split("/", 1)[0]
    if not bucket_exists(fs, bucket, storage):
        raise ConfigError(f"output.uri: the bucket {bucket!r} of {cfg.output.uri!r} does not exist (or these "
                          "credentials cannot see it); buckets are never created: create it, or fix output.uri")


def keep_schema(cfg: JobConfig) -> pa.Schema | None:
    """The run's schema of `input.columns.keep` (from the input's schema; None: nothing kept)."""
    if not cfg.input.columns.keep:
        return None
    from vlbatch.pipeline.sources import open_source

    return open_source(cfg).keep_schema()


def open_sink(cfg: JobConfig, run_uri: str) -> Sink:
    """The sink of one run (`run_uri` = `<output.uri>/<run_id>`): the one place that names the
    implementation (Parquet). Its schema: `OUTPUT_SCHEMA` plus the kept input columns."""
    return ParquetSink(run_uri, cfg.storage.options(), output_schema(keep_schema(cfg)))


def keep_schema_of(sink: Sink) -> pa.Schema | None:
    """The kept columns of `sink`'s schema (those past `OUTPUT_SCHEMA`), None if none."""
    schema = getattr(sink, "schema", OUTPUT_SCHEMA)
    extra = [f for f in schema if f.name not in OUTPUT_SCHEMA.names]
    return pa.schema(extra) if extra else None


class WriteStage:
    """Ray actor UDF around `write_batch`. An actor, not tasks, so it starts (process, imports,
    sink) together with the other pools at the start of the job instead of after the
    first model batch, and the first commit follows the first model batch at once.
    `run_dir`: the run's URI (`<output.uri>/<run_id>`)."""

    def __init__(self, cfg: JobConfig, run_dir: str, run_id: str):
        import uuid

        self.cfg, self.run_id = cfg, run_id
        self.sink = open_sink(cfg, run_dir)
        self.roller = PartRoller(self.sink, cfg.output.roll_policy(), group=f"w-{uuid.uuid4().hex[:16]}")

    def __call__(self, batch: pa.Table) -> pa.Table:
        return write_batch(batch, cfg=self.cfg, run_dir=self.sink.uri, run_id=self.run_id, sink=self.sink,
                           roller=self.roller)


def write_batch(batch: pa.Table, *, cfg: JobConfig, run_dir: str, run_id: str, sink: Sink | None = None,
                roller: PartRoller | None = None) -> pa.Table:
    """One batch of Generated rows to the run's sink (`run_dir`: its URI): committed as one part, or
    handed to `roller`; the stats table (one row per request; `file`: the part, None when rolled)."""
    gens = from_table(batch, Generated)
    rows = [o for g in gens for o in output_rows(g, cfg.model.path, run_id)]
    sink = sink if sink is not None else open_sink(cfg, run_dir)
    table = rows_to_table(rows)
    kept = keep_schema_of(sink)
    if kept is not None:  # the media's kept values, once per request
        extra = decode_keep([g.keep for g in gens], [len(g.ids) for g in gens], kept)
        for f in kept:
            table = table.append_column(f, extra.column(f.name))
    if roller is None:
        path = sink.commit(table)  # durable before any stats row
    else:
        roller.add(table)  # staged (durable) before any stats row
        path = None
    cached = {rid: c for g in gens for rid, c in zip(g.ids, g.cached_tokens, strict=True)}
    # media-level figures go on the media's first request only, so sums over stats rows are exact
    media = {g.ids[0]: {"vision_hits": g.vision_hits, "vision_encodes": g.vision_encodes, "decode_s": g.decode_s,
                        "preprocess_s": g.preprocess_s, "model_s": g.batch_model_s,
                        "model_cpu_s": g.batch_model_cpu_s} for g in gens}
    zero = {"vision_hits": 0, "vision_encodes": 0, "decode_s": 0.0, "preprocess_s": 0.0, "model_s": 0.0,
            "model_cpu_s": 0.0}
    return pa.Table.from_pylist([
        {"id": r.id, "status": r.status, "error_type": r.error_type, "prompt_tokens": r.prompt_tokens,
         "visual_tokens": r.visual_tokens, "generated_tokens": r.generated_tokens,
         "cached_tokens": cached.get(r.id), **media.get(r.id, zero), "file": path} for r in rows],
        schema=STATS_SCHEMA)
