"""`task.mode: scan`: the pipeline without a model.

Every request is read, decoded and preprocessed exactly as a real run does it (the
`PrepareStage` of `pipeline/stages/cpu.py`, in the same actor), and becomes a `Generated` row
with the status and error of its media, its prompt token count (the processor's
`input_ids`, visual placeholders included) and the media's visual tokens; answer,
generated tokens and finish reason stay null. No model is loaded and no GPU is asked for;
the pixel values never leave the actor. What a user runs before spending GPU hours (which
files are broken, what the job costs in tokens), and how the pipeline's own machinery is
benchmarked (`benchmarks/bench_scale.py`). The same actor writes the rows (`ScanStage`).
"""
from __future__ import annotations

import pyarrow as pa

from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.stages.rows import Generated, MediaTask, Prepared, clip_fields, from_table, to_table


def scanned(p: Prepared) -> Generated:
    """One preprocessed media row -> its scan row (one entry per request)."""
    n = len(p.ids)
    ok = p.status == "ok"
    return Generated(
        media_uri=p.media_uri, media_type=p.media_type, ids=p.ids, request_indices=p.request_indices,
        prompts=p.prompts, status=p.status, error_type=p.error_type, error_message=p.error_message,
        answers=(None,) * n, thinking=(None,) * n, statuses=(p.status,) * n,
        req_error_types=(None if ok else p.error_type,) * n, req_error_messages=(None if ok else p.error_message,) * n,
        finish_reasons=(None,) * n, prompt_tokens=tuple(len(x) for x in p.input_ids) if ok else (None,) * n,
        generated_tokens=(None,) * n, cached_tokens=(None,) * n, visual_tokens=p.visual_tokens,
        decode_s=p.decode_s, preprocess_s=p.preprocess_s, keep=p.keep,
        prompt_names=p.prompt_names, **clip_fields(p))


class ScanStage:
    """Ray actor UDF: MediaTask rows -> decode + preprocess (in this actor) -> scan rows.

    With `run_dir` (the runner's graph) the actor also writes them: its own `WriteStage`
    (a `PartRoller` of its own, the same staging and exactly-once rules as the write pool)
    and returns the write stats rows, so scan mode is one Ray Data operator and the rows
    never cross the object store (no writer pool, no writer process). Without it
    (tests) it returns the Generated scan rows."""

    def __init__(self, cfg: JobConfig, run_dir: str | None = None, run_id: str | None = None, meter=None):
        from vlbatch.pipeline.stages.cpu import PrepareStage

        self.prepare = PrepareStage(cfg, meter)  # progress: its decoded / preprocessed counts (telemetry/meter.py)
        self.writer = None
        if run_dir is not None:
            from vlbatch.pipeline.stages.write_stage import WriteStage

            self.writer = WriteStage(cfg, run_dir, run_id)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from vlbatch.pipeline.stages.cpu import requests_of
        from vlbatch.pipeline.telemetry.meter import DECODED, PREPROCESSED

        p = self.prepare
        tasks = from_table(batch, MediaTask)
        with p.lock:  # the roller is not thread-safe either
            rows = to_table([scanned(x) for r in tasks for x in p.preprocess.prepare_rows(p.decode.decode_one(r))],
                            Generated)
            out = rows if self.writer is None else self.writer(rows)
        meter, n = p.preprocess.meter, requests_of(tasks)
        meter.add(DECODED, n)
        meter.add(PREPROCESSED, n)
        meter.flush()
        return out


def _hist_text(h: dict) -> str:
    key = lambda k: 0 if k == "0" else int(k.split("-")[0])  # noqa: E731
    return " ".join(f"{k}:{h[k]}" for k in sorted(h, key=key)) or "-"


def cpu_s_per_request(s) -> float | None:
    """The CPU stage's measured cost per request: decode + preprocess actor-seconds / requests (None: nothing
    ran)."""
    n = sum(s.processed_by_status.values())
    cpu_s = s.stage_seconds.get("decode", 0.0) + s.stage_seconds.get("preprocess", 0.0)
    return cpu_s / n if n and cpu_s > 0 else None


def cpu_cost_text(s) -> str | None:
    """The CPU stage's cost per request measured by the scan and what it means for a model replica:
    generating R requests/s it needs that many seconds x R CPU cores to stay busy (R: measured by
    `engine_rate.scan_busy`, or a real run's `rows_per_s_busy`). None: nothing ran."""
    per = cpu_s_per_request(s)
    if per is None:
        return None
    return (f"decode + preprocess {per:.4f} CPU s per request: a model replica generating R requests/s needs "
            f"{per:.4f} x R CPU cores to stay busy (R: rows_per_s_busy of model_actors in a real run's "
            f"_summary.json; e.g. {1 / per:.1f} requests/s per core)")


def scan_line(s, busy: str | None = None) -> str:
    """The scan's final line (`s`: the run's `telemetry/summary.RunSummary`): totals, the token histograms,
    the CPU cost per request (`cpu_cost_text`) and `busy` (`engine_rate.scan_busy`: the model's measured
    rate here and the cores that keep it busy)."""
    cost = cpu_cost_text(s)
    return (f"vlbatch scan: {s.requests_computed} requests, {s.processed_by_status.get('error', 0)} errors "
            f"{dict(sorted(s.error_types.items()))}; prompt tokens {s.prompt_tokens}, visual tokens {s.visual_tokens}; "
            f"prompt histogram {_hist_text(s.token_histogram.get('prompt', {}))}; "
            f"visual histogram {_hist_text(s.token_histogram.get('visual', {}))}" + (f"; {cost}" if cost else "")
            + (f"; {busy}" if busy else ""))
