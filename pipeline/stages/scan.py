"""`task.mode: scan`: the pipeline without a model.

Every request is read, decoded and preprocessed exactly as a real run does it (the
`PrepareStage` of `pipeline/stages/prepare.py`, in the same actor), and becomes a `Generated` row
with the status and error of its media, its prompt token count (the processor's
`input_ids`, visual placeholders included) and the media's visual tokens; answer,
generated tokens and finish reason stay null. No model is loaded and no GPU is asked for;
the pixel values never leave the actor. What a user runs before spending GPU hours (which
files are broken, what the job costs in tokens), and how the pipeline's own machinery is
benchmarked (`benchmarks/bench_scale.py`). The same actor writes the rows (`ScanStage`).

Clips (`video.clips`): the scan cuts each video as the run will, by the run's own path
(`DecodeStage.decode_rows`: one decode, the detector on small frames for scenes, each clip sampled
and preprocessed) and writes one scan row per clip and prompt (`clip_index`, `clip_start_s`,
`clip_end_s`, `clip_source`, `clip_last`, its prompt and visual tokens). Why not estimate from the
header: (1) scenes need the detector's pass anyway, about a quarter of the scenes CPU stage (area-averaged
DETECT_WIDTH frames, `benchmarks/bench_clips.py`); (2) a header's duration may lie (a truncated upload, a wrong
`moov`): the run's clips come from the frames that really decode, so a count from the header would be
wrong exactly for the files a scan is meant to find; (3) the scan's CPU cost per request is then the
run's. So the scan reports what the run will do, never an estimate: a video whose header claims more
than decodes gets the clips of what decodes, and a file that does not decode is its error row. Per
video: its rows (clips, each clip's visual and prompt tokens; `vlbatch inspect RUN` prints a video's
clips as a timeline with their tokens and the video's total); the final line adds the clips, the
media cut, the sampled frames and visual tokens per clip (`clip_text`, from the meter's counts).
Resume: committed clips are dropped as in a run (`done`).
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

    def __init__(self, cfg: JobConfig, run_dir: str | None = None, run_id: str | None = None, meter=None,
                 done=None):
        from vlbatch.pipeline.stages.prepare import PrepareStage

        # progress: its decoded / preprocessed counts (telemetry/meter.py); done: committed ids, clips to drop
        self.prepare = PrepareStage(cfg, meter, done)
        self.writer = None
        if run_dir is not None:
            from vlbatch.pipeline.stages.write_stage import WriteStage

            self.writer = WriteStage(cfg, run_dir, run_id)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from vlbatch.pipeline.stages.row_fields import requests_of
        from vlbatch.pipeline.telemetry.meter import CLIP_VISUAL, DECODED, PREPROCESSED

        p = self.prepare
        tasks = from_table(batch, MediaTask)
        meter = p.preprocess.meter
        with p.lock:  # the roller is not thread-safe either
            got = [scanned(x) for r in tasks for d in self._decoded(r) for x in p.preprocess.prepare_rows(d)]
            rows = to_table(got, Generated)
            out = rows if self.writer is None else self.writer(rows)
        n = requests_of(got)  # clips: each clip's requests
        meter.add(DECODED, n)
        meter.add(PREPROCESSED, n)
        meter.add(CLIP_VISUAL, sum(g.visual_tokens for g in got if g.clip_index is not None and g.status == "ok"))
        meter.flush()
        return out

    def _decoded(self, row: MediaTask):
        """The row's `Decoded` rows: one, or a video's clips (counted for progress: `clip_rows.cut_counted`)."""
        d = self.prepare.decode
        if d.clips is None:
            return [d.decode_one(row)]
        from vlbatch.pipeline.stages.clip_rows import cut_counted

        return cut_counted(d.decode_rows(row), self.prepare.preprocess.meter)


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


def clip_text(counts: dict) -> str | None:
    """A clipped scan's figures from the meter's `counts` (`telemetry/meter.py`): clips, media cut, the
    sampled frames and visual tokens per clip. None: no clip was cut."""
    from vlbatch.pipeline.telemetry.meter import CLIP_FRAMES, CLIP_VISUAL, CLIPS, MEDIA_CUT

    clips, media = counts.get(CLIPS, 0), counts.get(MEDIA_CUT, 0)
    if not clips:
        return None
    return (f"clips {clips} of {media} media cut ({clips / max(media, 1):.1f} per media), per clip "
            f"{counts.get(CLIP_FRAMES, 0) / clips:.1f} sampled frames and {counts.get(CLIP_VISUAL, 0) / clips:.0f} "
            f"visual tokens (each video's clips: vlbatch inspect RUN)")


def scan_line(s, counts: dict | None = None, busy: str | None = None) -> str:
    """The scan's final line (`s`: the run's `telemetry/summary.RunSummary`): totals, the token histograms,
    the clips (`clip_text` of the meter's `counts`, a clipped run), the CPU cost per request (`cpu_cost_text`)
    and `busy` (`engine_rate.scan_busy`: the model's measured rate here and the cores that keep it busy)."""
    cost = cpu_cost_text(s)
    clips = clip_text(counts or {})
    return (f"vlbatch scan: {s.requests_computed} requests, {s.processed_by_status.get('error', 0)} errors "
            f"{dict(sorted(s.error_types.items()))}; prompt tokens {s.prompt_tokens}, visual tokens {s.visual_tokens}; "
            f"prompt histogram {_hist_text(s.token_histogram.get('prompt', {}))}; "
            f"visual histogram {_hist_text(s.token_histogram.get('visual', {}))}" + (f"; {clips}" if clips else "")
            + (f"; {cost}" if cost else "")
            + (f"; {busy}" if busy else ""))
