"""`RunSummary`: what one `run_job` call did and what the run directory now holds (`_summary.json`),
and `summarize`, made from the run's `Progress`, its sink's index before and after, and its timeline."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


def past_error_limits(error_rows: int, error_fraction: float, max_error_fraction: float,
                      min_error_rows: int) -> bool:
    """The run's error rule (a run and a rerun with nothing to do, `startup/nothing_to_do.py`, say the same):
    failed only past both limits, an error share over `max_error_fraction` and at least `min_error_rows`
    error rows."""
    return error_fraction > max_error_fraction and error_rows >= min_error_rows


def error_limits_text(error_rows: int, error_fraction: float, max_error_fraction: float, min_error_rows: int) -> str:
    """Which error limit was passed and the verdict, e.g. ``1 error row: 7% > max_error_fraction 5%, 1 <
    min_error_rows 10: exit 0 (a run fails only past both)``."""
    n = error_rows
    share = ">" if error_fraction > max_error_fraction else "<="
    rows = ">=" if n >= min_error_rows else "<"
    if past_error_limits(n, error_fraction, max_error_fraction, min_error_rows):
        verdict = "failed"
    elif share == ">" or rows == ">=":
        verdict = "exit 0 (a run fails only past both)"
    else:
        verdict = "errors stayed under the limits"
    return (f"{n} error row{'s' if n != 1 else ''}: {error_fraction:.0%} {share} max_error_fraction "
            f"{max_error_fraction:.0%}, {n} {rows} min_error_rows {min_error_rows}: {verdict}")


@dataclass(frozen=True)
class RunSummary:
    """What one `run_job` call did and what the run directory now holds."""

    run_id: str
    output_dir: str  # full URI of the run directory
    requests_pending: int  # requests still pending when this call ended (0: a finished run)
    requests_skipped: int  # requests already committed before this call
    requests_computed: int = 0  # requests this call computed (those pending when it started)
    processed_by_status: dict = field(default_factory=dict)  # this call
    error_types: dict = field(default_factory=dict)  # this call
    quality_flags: dict = field(default_factory=dict)  # this call: ok answers per flag (operators/quality.py)
    committed_by_status: dict = field(default_factory=dict)  # the whole run directory, after this call
    committed_total: int = 0
    purged_transient: int = 0
    duplicate_ids: int = 0  # ids committed more than once (duplicates in different manifest blocks)
    duplicates_dropped: int | None = 0  # identical requests run once, not again (this call; None: not counted
    # before the run ended)
    elapsed_s: float = 0.0
    rows_per_s: float = 0.0  # this call's rows / elapsed since the graph started (start-up included)
    time_to_first_row_s: float | None = None  # start-up: Ray actors, model load, first batch (from the graph's start)
    first_row_after_s: float | None = None  # from the start of `run_job` (sink, Ray, expansion included) to the
    # first committed row
    model_ready_after_s: float | None = None  # from the start of `run_job` to the first model actor ready (as the
    # progress ticker saw it: within one tick)
    steady_rows_per_s: float | None = None  # rows after the first commit / time from the first to the last commit
    expand_s: float = 0.0  # reading + expanding the manifest before the graph starts (a resumed run; ~0 on a
    # fresh run, whose expansion streams into the graph)
    visual_tokens_per_s: float = 0.0
    generated_tokens_per_s: float = 0.0
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served by the prefix cache / prompt tokens
    vision_cache_hit_rate: float = 0.0  # media served by the vision cache / media looked up
    error_fraction: float = 0.0  # error rows / rows, the whole run directory
    max_error_fraction: float = 0.0
    min_error_rows: int = 0  # the run fails only past both limits: the share and this many error rows
    files_written: int = 0
    # summed busy time per stage (decode, preprocess, model; model_cpu: CPU s of the engine thread)
    stage_seconds: dict = field(default_factory=dict)
    prompt_tokens: int = 0  # this call, summed over requests (visual placeholders included)
    visual_tokens: int = 0  # this call, per request (a media asked 3 questions counts 3 times)
    token_histogram: dict = field(default_factory=dict)  # {"prompt"|"visual": {"<lo>-<hi>": requests}}
    generated_tokens: int = 0  # this call
    cached_tokens: int = 0  # this call: prompt tokens served by the prefix cache
    # the model stage's busy / waiting shares, the CPU pools' busy share, the pool to grow (`Occupancy.to_json`)
    occupancy: dict = field(default_factory=dict)
    # per model actor: busy / waiting shares of its window, rows/s and generated tokens/s while busy beside
    # the whole run's (`ActorOccupancy.to_json`)
    model_actors: list = field(default_factory=list)
    timeline: dict = field(default_factory=dict)  # this call's rows and tokens over time (`Timeline.to_json`)
    failed_starts: list = field(default_factory=list)  # "<Stage> on node IP (id): cause" per actor that failed to start
    attempts: list = field(default_factory=list)  # every call's record on this run, this one last (attempts.py)
    run_timeline: dict = field(default_factory=dict)  # every call's timeline, one after another (attempts.py)

    @property
    def error_rows(self) -> int:
        """Error rows in the run directory (what `error_fraction` counts)."""
        return self.committed_by_status.get("error", 0)

    @property
    def exceeded_error_fraction(self) -> bool:
        """Past both limits (`past_error_limits`): one broken file in a 14-media trial is 7 % but no failed run."""
        return past_error_limits(self.error_rows, self.error_fraction, self.max_error_fraction, self.min_error_rows)

    @property
    def exit_code(self) -> int:
        """1 past both error limits (`exceeded_error_fraction`), else 0."""
        return 1 if self.exceeded_error_fraction else 0

    def errors_text(self) -> str | None:
        """What the run's errors mean for its exit, for the final line; None without an error row, e.g.
        ``all rows written; 1 error row: 7% > max_error_fraction 5%, 1 < min_error_rows 10: exit 0 (a run
        fails only past both)``."""
        if not self.error_rows:
            return None
        written = "all rows written" if not self.requests_pending else f"{self.requests_pending} requests pending"
        return f"{written}; " + error_limits_text(self.error_rows, self.error_fraction, self.max_error_fraction,
                                                  self.min_error_rows)

    def to_json(self) -> str:
        d = asdict(self)
        d["exceeded_error_fraction"] = self.exceeded_error_fraction
        d["exit_code"] = self.exit_code
        return json.dumps(d, indent=2, sort_keys=True)


def summarize(cfg, run_id, run_uri, progress, before, after, purged, dropped, pending_n, *, elapsed, expand_s,
             graph_at, timeline=None, failed_starts=()):
    total = sum(after.status_counts.values())
    errors = after.status_counts.get("error", 0)
    rates = progress.rates()
    skipped = len(before.done_ids) if cfg.resume.retry_transient else len(before.done_ids | before.transient_ids)
    return RunSummary(
        run_id=run_id, output_dir=run_uri, requests_pending=max(0, pending_n - progress.done),
        requests_skipped=skipped, requests_computed=pending_n,
        processed_by_status=dict(progress.status), error_types=dict(progress.error_types),
        quality_flags=dict(progress.quality),
        committed_by_status=dict(after.status_counts), committed_total=total, purged_transient=purged,
        duplicate_ids=after.duplicate_ids, duplicates_dropped=dropped, elapsed_s=elapsed,
        rows_per_s=rates["rows_per_s"], visual_tokens_per_s=rates["visual_tokens_per_s"],
        time_to_first_row_s=rates["time_to_first_row_s"], steady_rows_per_s=rates["steady_rows_per_s"],
        first_row_after_s=None if rates["time_to_first_row_s"] is None else graph_at + rates["time_to_first_row_s"],
        model_ready_after_s=None if progress.model_ready_at is None else
        graph_at + progress.model_ready_at - progress.start,
        expand_s=round(expand_s, 3), generated_tokens_per_s=rates["generated_tokens_per_s"],
        prefix_cache_hit_rate=rates["prefix_cache_hit_rate"], vision_cache_hit_rate=rates["vision_cache_hit_rate"],
        error_fraction=(errors / total) if total else 0.0, max_error_fraction=cfg.max_error_fraction,
        min_error_rows=cfg.min_error_rows,
        files_written=len(set(after.files) - set(before.files)),
        stage_seconds={k: round(v, 3) for k, v in progress.stage_s.items()},
        prompt_tokens=progress.prompt_tokens, visual_tokens=progress.visual_tokens,
        generated_tokens=progress.generated_tokens, cached_tokens=progress.cached_tokens,
        occupancy=occ.to_json() if (occ := progress.occupancy(final=True)) is not None else {},
        model_actors=progress.model_actors(final=True),
        token_histogram={"prompt": dict(progress.prompt_hist), "visual": dict(progress.visual_hist)},
        timeline=timeline.to_json() if timeline is not None else {}, failed_starts=list(failed_starts))
