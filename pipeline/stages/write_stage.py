"""The write stage: Generated rows -> rolling part files on the run's sink.

Runs as a Ray actor pool (`WriteStage`, `resources.write`: min..max actors, so writers scale
with throughput). Each call explodes its media rows into one `OutputRow` per request,
hands them to the actor's `PartRoller` (`vlbatch.operators.sink.rolling`: staged durably at
once, published in parts of `output.part_mb` / `output.part_rows`, at least every
`output.commit_interval_s`: the actor's `PublishTimer` thread publishes held rows when due, whether
or not another call comes; the exactly-once design is in `vlbatch.operators.sink.parquet`) and
returns a small stats table, one row per request, that the driver aggregates for progress
and the run summary. The rows are staged (durable, published by the writer or by the
runner's `sink.seal()` at the end) before the stats row exists.

A commit that fails after all storage retries raises `StorageError` and the job stops with
that error; a rerun commits the rows (resume). A write actor that dies is restarted by Ray
Data and its batch retried with the same rows, which the sink commits once.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vlbatch.operators.quality import QualityJudge
from vlbatch.operators.sink.base import Sink
from vlbatch.operators.sink.rolling import PartRoller, PublishTimer
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA, TIMINGS_TYPE, OutputRow, Timings, rows_to_table
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.plan.sink import open_sink
from vlbatch.pipeline.sources.keep import decode as decode_keep
from vlbatch.pipeline.stages.rows import CLIP_FIELDS, Generated, clip_fields, from_table

STATS_SCHEMA = pa.schema([
    ("id", pa.string()), ("status", pa.string()), ("error_type", pa.string()), ("prompt_tokens", pa.int64()),
    ("visual_tokens", pa.int64()), ("generated_tokens", pa.int64()), ("cached_tokens", pa.int64()),
    ("vision_hits", pa.int64()), ("vision_encodes", pa.int64()), ("decode_s", pa.float64()),
    ("preprocess_s", pa.float64()), ("model_s", pa.float64()), ("model_cpu_s", pa.float64()),
    ("quality_flags", pa.list_(pa.string())), ("file", pa.string()),
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
            prompt_name=g.prompt_names[i], parsed=g.parsed[i] if ok else None,
            error_type=None if ok else g.req_error_types[i], error_message=None if ok else g.req_error_messages[i],
            prompt_tokens=g.prompt_tokens[i], visual_tokens=g.visual_tokens or None,
            generated_tokens=g.generated_tokens[i], finish_reason=g.finish_reasons[i], timings=timings,
            **clip_fields(g)))
    return out


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
        self.timer = PublishTimer(self.roller)  # the interval kept between calls (a writer may get no next one)
        self.judge = QualityJudge()  # this actor's answers so far: the relative quality checks

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.timer.check()  # a publish between calls that failed: the run stops with its StorageError
        return write_batch(batch, cfg=self.cfg, run_dir=self.sink.uri, run_id=self.run_id, sink=self.sink,
                           roller=self.roller, judge=self.judge)


_MEDIA_FIGURES = {"vision_hits": "vision_hits", "vision_encodes": "vision_encodes", "decode_s": "decode_s",
                  "preprocess_s": "preprocess_s", "model_s": "batch_model_s", "model_cpu_s": "batch_model_cpu_s"}


def output_tables(batch: pa.Table, model: str, run_id: str) -> tuple[pa.Table, pa.Table]:
    """A batch of Generated rows [M media] -> (OUTPUT_SCHEMA table, STATS_SCHEMA table without `file`),
    one row per request [R = sum of the media's requests], column by column (no Python object per
    row). The same rows as `output_tables_naive` (`output_rows` per media); media-level figures go
    on each media's first request only, so sums over stats rows are exact."""
    n = pc.list_value_length(batch["ids"]).to_numpy(zero_copy_only=False)  # [M]
    media = pa.array(np.repeat(np.arange(len(n)), n))  # [R] the media of each request
    flat = lambda c: pc.list_flatten(batch[c])  # noqa: E731
    per = lambda c: batch[c].take(media)  # noqa: E731
    ok = pc.equal(flat("statuses"), "ok")
    null = pa.scalar(None, pa.string())
    visual = per("visual_tokens")
    visual = pc.if_else(pc.equal(visual, 0), pa.scalar(None, visual.type), visual)  # 0 -> null, as `or None`
    timings = pa.StructArray.from_arrays([per("decode_s").combine_chunks(), per("preprocess_s").combine_chunks(),
                                          per("model_s").combine_chunks()], fields=list(TIMINGS_TYPE))
    r = len(media)
    out = {"id": flat("ids"), "request_index": flat("request_indices"), "media_uri": per("media_uri"),
           "media_type": per("media_type"), "prompt": flat("prompts"), "answer": pc.if_else(ok, flat("answers"), null),
           "thinking": pc.if_else(ok, flat("thinking"), null), "status": pc.if_else(ok, "ok", "error"),
           "prompt_name": flat("prompt_names"), "parsed": pc.if_else(ok, flat("parsed"), null),
           "error_type": pc.if_else(ok, null, flat("req_error_types")),
           "error_message": pc.if_else(ok, null, flat("req_error_messages")), "prompt_tokens": flat("prompt_tokens"),
           "visual_tokens": visual, "generated_tokens": flat("generated_tokens"),
           "finish_reason": flat("finish_reasons"), "quality_flags": pa.nulls(r, pa.list_(pa.string())),
           "model": pa.array([model] * r, pa.string()),
           "run_id": pa.array([run_id] * r, pa.string()), "timings": timings,
           **{k: per(k) for k in CLIP_FIELDS}}
    table = pa.table({f.name: pc.cast(out[f.name], f.type) for f in OUTPUT_SCHEMA}, schema=OUTPUT_SCHEMA)
    first = np.zeros(r, bool)
    first[(np.cumsum(n) - n)[n > 0]] = True  # [R] each media's first request
    mask = pa.array(first)
    stats = {k: table[k] for k in ("id", "status", "error_type", "prompt_tokens", "visual_tokens", "generated_tokens",
                                   "quality_flags")}
    stats["cached_tokens"] = flat("cached_tokens")
    for k, src in _MEDIA_FIGURES.items():
        typ = STATS_SCHEMA.field(k).type
        stats[k] = pc.if_else(mask, pc.cast(per(src), typ), pa.scalar(0, typ))
    return table, pa.table({f.name: pc.cast(stats[f.name], f.type) for f in STATS_SCHEMA if f.name != "file"})


def judged(table: pa.Table, stats: pa.Table, judge: QualityJudge) -> tuple[pa.Table, pa.Table]:
    """(output table, stats) with `quality_flags` filled by `judge` (null on error rows)."""
    flags = pa.array(judge.flags(table["answer"].to_pylist(), table["finish_reason"].to_pylist(),
                                 table["prompt"].to_pylist(), table["media_uri"].to_pylist()), pa.list_(pa.string()))
    col = table.schema.get_field_index("quality_flags")
    return (table.set_column(col, table.schema.field(col), flags),
            stats.set_column(stats.schema.get_field_index("quality_flags"), "quality_flags", flags))


def write_batch(batch: pa.Table, *, cfg: JobConfig, run_dir: str, run_id: str, sink: Sink | None = None,
                roller: PartRoller | None = None, judge: QualityJudge | None = None) -> pa.Table:
    """One batch of Generated rows to the run's sink (`run_dir`: its URI): committed as one part, or
    handed to `roller`; the stats table (one row per request; `file`: the part, None when rolled).
    `judge`: the caller's quality state (a write actor keeps one); None: a fresh one for this batch."""
    sink = sink if sink is not None else open_sink(cfg, run_dir)
    table, stats = judged(*output_tables(batch, cfg.model.path, run_id), judge or QualityJudge())
    kept = keep_schema_of(sink)
    if kept is not None:  # the media's kept values, once per request
        extra = decode_keep(batch["keep"].to_pylist(), pc.list_value_length(batch["ids"]).to_pylist(), kept)
        for f in kept:
            table = table.append_column(f, extra.column(f.name))
    if roller is None:
        path = sink.commit(table)  # durable before any stats row
    else:
        roller.add(table)  # staged (durable) before any stats row
        path = None
    return stats.append_column(STATS_SCHEMA.field("file"), pa.array([path] * stats.num_rows, pa.string()))


def output_tables_naive(batch: pa.Table, model: str, run_id: str) -> tuple[pa.Table, pa.Table]:
    """The reference for `output_tables`: one `OutputRow` per request (`output_rows`), the
    media-level figures on each media's first request."""
    gens = from_table(batch, Generated)
    table = rows_to_table([o for g in gens for o in output_rows(g, model, run_id)])
    stats = []
    for g in gens:
        for i, o in enumerate(output_rows(g, model, run_id)):
            fig = {k: getattr(g, src) if i == 0 else 0 for k, src in _MEDIA_FIGURES.items()}
            stats.append({"id": o.id, "status": o.status, "error_type": o.error_type,
                          "prompt_tokens": o.prompt_tokens, "visual_tokens": o.visual_tokens,
                          "generated_tokens": o.generated_tokens, "cached_tokens": g.cached_tokens[i], **fig,
                          "quality_flags": None})
    return table, pa.Table.from_pylist(stats, schema=pa.schema([f for f in STATS_SCHEMA if f.name != "file"]))
