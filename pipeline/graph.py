"""`run_job(config) -> RunSummary`: the Ray Data graph from a manifest to the committed output.

    manifest (parquet/json/csv or a glob)                  Ray read tasks (fractional CPUs; never 1-CPU tasks
                                                           once the pools hold the cluster, see sources/manifest.py)
      -> expand to requests, drop committed ids (resume)   tasks; streamed into the graph on a fresh run,
         and identical requests within a block (once)
                                                           materialised (and counted) first on a resumed one
      -> decode: bytes -> frames                           actor pool (CPU), killable subprocess
      -> preprocess: frames -> pixel values + tokens       actor pool (CPU); with
                                                           resources.fuse_cpu_stages one pool does both
      -> model: engine generate, batches cut by visual tokens   actor pool (num_gpus, min..max)
      -> write: one atomic sink commit per batch           actor pool (small); stats rows back to the driver

With `task.mode: scan` the model stage and the write pool are left out: one CPU pool decodes,
preprocesses and writes the scan rows (`pipeline/stages/scan.py`); nothing asks for a GPU. Its Ray
Data blocks are small (`block_bytes`), so every actor of the pool gets work.

Counting: a resumed run counts its pending requests while it expands (materialised); a fresh
one takes the manifest's row count from the source (`Source.count()`: Parquet footers) and
the expansion tasks' counts from a `Tally` actor (`expansion.py`), never a second read of the manifest.
Resume memory: the committed ids are one `IdIndex` (16 B per id, sorted numpy), `ray.put`
once and mapped zero-copy by each expansion task (no per-task copy of a Python set).

Output: the run's sink (`write_stage.open_sink`, at `<output.uri>/<run_id>`; Parquet: rolling
part files and `_summary.json` beside them; `sink.seal()` after the graph publishes what the
writers still held). Only the sink contract is used here
(`vlbatch.operators.sink.base`): before the graph starts its committed index is read:
committed ok / permanent-error rows are skipped, transient error rows purged and redone.
After it finishes the index is read again to count the whole run (all attempts), and the
sink's `finish()` drops what the commits left behind (an empty `_tmp/`).

Start-up refuses what would fail later: an output bucket that does not exist
(`write_stage.check_output`, ConfigError naming output.uri; buckets are never created) and,
on a local Ray of fixed size, actor pools that cannot all start (`check_cpus_fit`,
ConfigError naming resources). An actor that fails to start on a node (a model replica whose
checkpoint cache there is unwritable): its pool avoids that node and the run goes on
(`RunSummary.failed_starts`), or stops in one line when no node is left (`pipeline/stages/placement.py`).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.storage import join
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.stages.expansion import STREAMED_EXPAND, Tally, count_pending, expanded
from vlbatch.pipeline.plan.fingerprint import check_fingerprint, record_fingerprint
from vlbatch.pipeline.telemetry.meter import driver_node
from vlbatch.pipeline.stages.placement import INIT_DEATHS
from vlbatch.pipeline.telemetry.progress import Progress
from vlbatch.pipeline.stages.scan import scan_line
from vlbatch.pipeline.telemetry.timeline import Timeline
from vlbatch.pipeline.stages.write_stage import check_output, open_sink

log = logging.getLogger("vlbatch.pipeline")


@dataclass(frozen=True)
class RunSummary:
    """What one `run_job` call did and what the run directory now holds."""

    run_id: str
    output_dir: str  # full URI of the run directory
    requests_pending: int  # requests this call had to compute
    requests_skipped: int  # requests already committed before this call
    processed_by_status: dict = field(default_factory=dict)  # this call
    error_types: dict = field(default_factory=dict)  # this call
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
    error_fraction: float = 0.0
    max_error_fraction: float = 0.0
    files_written: int = 0
    stage_seconds: dict = field(default_factory=dict)  # summed busy time per stage (decode, preprocess, model; model_cpu: CPU s of the engine thread)
    prompt_tokens: int = 0  # this call, summed over requests (visual placeholders included)
    visual_tokens: int = 0  # this call, per request (a media asked 3 questions counts 3 times)
    token_histogram: dict = field(default_factory=dict)  # {"prompt"|"visual": {"<lo>-<hi>": requests}}
    timeline: dict = field(default_factory=dict)  # this call's rows and tokens over time (`Timeline.to_json`)
    failed_starts: list = field(default_factory=list)  # "<Stage> on node IP (id): cause" per actor that failed to start

    @property
    def exceeded_error_fraction(self) -> bool:
        return self.error_fraction > self.max_error_fraction

    @property
    def exit_code(self) -> int:
        """0 when the error share is within `max_error_fraction`, else 1."""
        return 1 if self.exceeded_error_fraction else 0

    def to_json(self) -> str:
        d = asdict(self)
        d["exceeded_error_fraction"] = self.exceeded_error_fraction
        d["exit_code"] = self.exit_code
        return json.dumps(d, indent=2, sort_keys=True)


SCAN_BATCH_SIZE = 256  # media per scan-actor call when resources.preprocess.batch_size is not set (`scan_batch_size`)
MIN_BLOCK_BYTES = 64 << 10
SCAN_BLOCK_BYTES = 512 << 10  # scan: ~1700 media rows a block (MediaTask / Generated; 64 KiB: 11 % slower at 200k), see `block_bytes`


def _init_ray(cfg: JobConfig) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, log_to_driver=False, logging_level=logging.WARNING,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    # an actor that dies while starting is replaced (Ray Data's default, 0, fails the run at once): one
    # that cannot start on a node is retried off that node (pipeline/stages/placement.py)
    ctx.max_consecutive_actor_init_deaths = INIT_DEATHS
    # A CPU-stage task emits its output (pixel values) in blocks of up to this size, and a
    # model task takes whole blocks: with Ray Data's default (128 MiB, ~100 media of a few
    # hundred visual tokens) the model stage took ~100 media per task and committed them only
    # at its end (first commit after minutes). 16 MiB: a few media per block.
    ctx.target_max_block_size = block_bytes(cfg)


def block_bytes(cfg: JobConfig) -> int:
    """Ray Data's target block size for this job. Scan mode: `SCAN_BLOCK_BYTES`, since no tensor
    crosses the object store there and a manifest row group (one block of up to ~1M media
    rows: Ray Data splits a block only past 1.5x this size) must be spread over every CPU
    actor, not given whole to one (measured: one of two actors did all the work, 0.48 of the
    plain loop). 512 KiB (~1700 media): smaller blocks cost Ray Data per-block work in the
    driver and its own actors (64 KiB was 11 % slower at 200k requests on 2 cores), larger ones
    balance worse at the end of a run.

    Otherwise blocks of pixel values: `ray.block_mb`, or less when `image.max_pixels` bounds a
    media's frames (a block closes past `resources.model.batch_size - 1` media at the budget,
    at least `MIN_BLOCK_BYTES`). A model task is one block and one call (`batch_size=None`),
    and Ray Data hands its output on only when the task ends, so the block size is how soon
    finished rows reach the writer: 16 MiB blocks held ~85 media of 256x256 and the first row
    of a 400-media run was committed after 60 s of 70 (issue 33). Small blocks do not shrink
    the engine's batch: `max_concurrent_batches` tasks feed it at once (pipeline/stages/model_stage.py)."""
    if cfg.task.mode == "scan":
        return SCAN_BLOCK_BYTES
    cap = cfg.ray.block_mb << 20
    if cfg.image.max_pixels is None:  # the checkpoint's budget (megapixels): a few media fill a block anyway
        return cap
    per_media = 3 * cfg.image.max_pixels  # uint8 RGB frames at the budget
    want = per_media * max(1, cfg.resources.model.batch_size - 1)  # a block closes past this: ~batch_size media
    return max(MIN_BLOCK_BYTES, min(cap, want))


def scan_batch_size(cfg: JobConfig, source) -> int:
    """Media per scan-actor call: `resources.preprocess.batch_size` when the config sets it or
    the rows embed their media's bytes (`source.embeds_media()`: a batch holds them all), else
    `SCAN_BATCH_SIZE`. Each call stages its rows as one file (exactly once, `pipeline/stages/scan.py`)
    and the end of the run reads back what is still staged: 256 media (1024 rows of 4
    questions) staged in 13 us per media against 35 at 64, a quarter of the files to read
    back, a quarter of Ray Data's per-batch work. A call's frames are one media's at a time."""
    pre = cfg.resources.preprocess
    if "batch_size" in pre.model_fields_set or source.embeds_media():
        return pre.batch_size
    return SCAN_BATCH_SIZE


def model_gpus(cfg: JobConfig) -> float:
    """GPUs per model actor: `resources.model.num_gpus`, or 0 when the cluster has no GPU and
    `model.device` is `auto` (the model then runs on CPU instead of waiting forever for a
    GPU). `device: cuda` keeps the request, for autoscaling clusters that add GPU nodes."""
    import ray

    want = cfg.resources.model.num_gpus
    if want > 0 and cfg.model.device == "auto" and not ray.cluster_resources().get("GPU", 0):
        log.warning("no GPU in the Ray cluster: the model stage runs on CPU (set model.device=cuda to wait for GPUs)")
        return 0.0
    return want


def check_cpus_fit(cfg: JobConfig, cluster_cpus: float, *, fixed_size: bool) -> None:
    """The actor pools at their minimum sizes, plus the streamed manifest read, against the
    cluster's CPUs. A pool that cannot start waits until another shrinks, so nothing is
    committed (no progress, no resume point) or, when the read cannot run either, nothing
    moves at all. On a cluster of fixed size (a local Ray) that is refused (`ConfigError`
    naming resources); a remote cluster may add nodes, so there it is one warning line."""
    r = cfg.resources
    pools = [r.preprocess] if r.fuse_cpu_stages or cfg.task.mode == "scan" else [r.decode, r.preprocess]
    if cfg.task.mode != "scan":  # scan: the preprocess actors write their own rows
        pools.append(r.write)
    need = sum(p.num_cpus * p.min_actors for p in pools) + STREAMED_EXPAND["num_cpus"]
    if cfg.task.mode != "scan":  # every rank of a model replica
        need += r.model.num_cpus * r.model.min_actors * cfg.model.tensor_parallel_size
    if not cluster_cpus or need <= cluster_cpus:
        return
    what = (f"resources: the actor pools at min_actors and the manifest read need {need:.2f} CPUs but the "
            f"cluster has {cluster_cpus:.2f}")
    if fixed_size:
        raise ConfigError(f"{what}; lower resources.*.num_cpus or min_actors")
    log.warning("%s: later stages wait for earlier ones to finish (unless the cluster adds nodes); lower "
                "resources.*.num_cpus or min_actors", what)


def build_graph(cfg: JobConfig, source, tasks_ds, run_dir: str, run_id: str, meter=None, failures=None):
    """The lazy dataset of write stats rows (`source`: the run's `Source`; `run_dir`: the run's URI, where its
    sink is; `meter`: the run's `Meter` actor the stages count into, pipeline/telemetry/meter.py; `failures`: its
    `RunPlacement`: failed starts and each pool's resources, pipeline/stages/placement.py)."""
    import ray

    from vlbatch.pipeline.stages.model_stage import ModelStage
    from vlbatch.pipeline.stages.placement import map_stage
    from vlbatch.pipeline.stages.replica import replica_resources
    from vlbatch.pipeline.stages.cpu import DecodeStage, PrepareStage, PreprocessStage
    from vlbatch.pipeline.stages.write_stage import WriteStage

    r = cfg.resources

    def pool(stage, **strategy):
        kw = {"num_cpus": stage.num_cpus,
              "compute": ray.data.ActorPoolStrategy(min_size=stage.min_actors, max_size=stage.max_actors, **strategy)}
        if stage.memory_gb:
            kw["memory"] = int(stage.memory_gb * 2**30)
        return kw

    def stage(ds, cls, kwargs, batch_size, resources):
        return map_stage(ds, cls, failures, fn_constructor_kwargs=kwargs, batch_size=batch_size, batch_format="pyarrow",
                    **resources)

    check_cpus_fit(cfg, ray.cluster_resources().get("CPU", 0.0), fixed_size=cfg.ray.address is None)
    write_kw = {"cfg": cfg, "run_dir": run_dir, "run_id": run_id}
    if cfg.task.mode == "scan":  # no model: decode + preprocess -> scan rows -> written, in one CPU pool
        from vlbatch.pipeline.stages.scan import ScanStage  # (pipeline/stages/scan.py; no write pool)

        return stage(tasks_ds, ScanStage, {**write_kw, "meter": meter}, scan_batch_size(cfg, source), pool(r.preprocess))
    stage_kw = {"cfg": cfg, "meter": meter}
    if r.fuse_cpu_stages:  # decode + preprocess in one actor: MediaTask -> Prepared
        ds = stage(tasks_ds, PrepareStage, stage_kw, r.preprocess.batch_size, pool(r.preprocess))
    else:
        ds = stage(tasks_ds, DecodeStage, stage_kw, r.decode.batch_size, pool(r.decode))
        ds = stage(ds, PreprocessStage, stage_kw, r.preprocess.batch_size, pool(r.preprocess))
    # concurrent calls on one model actor feed one continuous batch (pipeline/stages/model_stage.py)
    gpus = model_gpus(cfg)  # per rank; a replica of model.tensor_parallel_size ranks: pipeline/stages/replica.py
    # batch_size=None: one call per block, so a task's rows are handed on when that call ends (block_bytes).
    # Ray Data refuses batch_size=None for an operator that requests GPUs ("You must provide `batch_size`"):
    # there the model batch size, which the blocks are already sized to, gives about one call per block too.
    ds = stage(ds, ModelStage, stage_kw, None if not gpus else r.model.batch_size,
               replica_resources(cfg, gpus, pool(r.model, enable_true_multi_threading=True,
                                                 max_concurrent_calls_per_actor=r.model.max_concurrent_batches)))
    return stage(ds, WriteStage, write_kw, r.write.batch_size, pool(r.write))


def _stream_graph(cfg: JobConfig, source, tasks_ds, sink, run_id: str, progress: Progress, tally,
                  known: int | None, timeline: Timeline) -> list[str]:
    """Run the graph, feeding its stats rows to `progress`; a `Ticker` thread reads the meter (and the
    tally until `known` media are read) and prints progress meanwhile, committed rows or not. -> the
    start failures the run went on without (`placement.failed_lines`); a pool's nodes lost: `watching_nodes`."""
    from vlbatch.pipeline.telemetry.meter import Ticker, start_meter
    from vlbatch.pipeline.stages.placement import RunPlacement, failed_lines, start_failures, watching_nodes

    meter, placement = start_meter(), RunPlacement(start_failures())
    graph = build_graph(cfg, source, tasks_ds, sink.uri, run_id, meter=meter, failures=placement)
    progress.set_phase("starting the actors and loading the model" if cfg.task.mode != "scan" else
                       "starting the actors", sticky=cfg.task.mode != "scan")
    every = 0.2 if progress.tty else min(1.0, cfg.ray.progress_interval_s)
    with Ticker(progress, meter, tally, known, every_s=every), watching_nodes(placement, cfg.ray):
        # prefetch_batches=0: each stats block as soon as it exists (prefetching holds one back)
        for stats in graph.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=0):
            progress.update(stats)
            timeline.update(stats)
    return failed_lines(placement.failures)


def _open_run(cfg: JobConfig, run_uri: str):
    """(sink, index before the run, transient rows purged, committed ids to skip)."""
    sink = open_sink(cfg, run_uri)
    sink.prepare()
    index = sink.index()
    if index.files and not cfg.resume.enabled:
        raise ConfigError(f"resume.enabled=false but {run_uri} already holds {len(index.files)} committed files; "
                          "set resume.enabled=true to continue that run or choose a new output.run_id")
    purged = sink.purge(index.purgeable_ids) if cfg.resume.retry_transient else 0
    done = index.done_ids if cfg.resume.retry_transient else index.done_ids | index.transient_ids
    return sink, index, purged, done


def run_job(cfg: JobConfig, *, stream=None, plan=None) -> RunSummary:
    """Run (or resume) a job to completion; returns its summary, also written as `_summary.json`.
    `plan`: the run's `RunPlan` (pipeline/plan/spec.py), already printed by the caller; None: made
    and printed here, first."""
    import ray

    from vlbatch.pipeline.plan.spec import plan_run

    stream = stream or sys.stderr
    t0 = time.monotonic()
    run_id = cfg.resolved_run_id()
    run_uri = join(cfg.output.uri.rstrip("/"), run_id)
    check_output(cfg)  # a missing bucket: ConfigError now, never a new bucket
    check_fingerprint(cfg)  # answers made with another config under this run id: ConfigError now
    if plan is None:
        plan = plan_run(cfg)
        _say(stream, plan.line())
    sink, index, purged, done = _open_run(cfg, run_uri)
    record_fingerprint(cfg, had_rows=bool(index.files))

    if not ray.is_initialized():
        _say(stream, "[vlbatch] starting Ray")
    _init_ray(cfg)
    t_expand = time.monotonic()
    source = plan.source  # one per run: its listing and first schema are read once
    tasks_ds, pending_n, dropped, tally, known = _expansion(source, done, plan, stream)
    del done  # the driver keeps only its length (below) and the index
    t_graph = time.monotonic()
    progress = Progress(total=pending_n if pending_n is not None else plan.requests, stream=stream,
                        interval_s=cfg.ray.progress_interval_s,
                        expect_models=None if cfg.task.mode == "scan" else cfg.resources.model.min_actors)
    timeline, failed = Timeline(), []
    if pending_n is None or pending_n:
        failed = _stream_graph(cfg, source, tasks_ds, sink, run_id, progress, tally, known, timeline)
    for line in failed:
        _say(stream, f"[vlbatch] an actor failed to start: {line}; the run went on without that node")
    progress.set_phase(None)
    policy = cfg.output.roll_policy()
    sealed = sink.seal(policy.target_rows, policy.target_bytes)  # what writers still held at the end
    if tally is not None:
        dropped = ray.get(tally.get.remote())[2]
    elif dropped is None:  # nothing reached the writer: no duplicate was dropped either
        dropped = 0
    if pending_n is None:  # the graph completed: every pending request gave one stats row
        pending_n = progress.total = progress.done
    progress.tick(final=True)
    after = sink.index()
    summary = _summary(cfg, run_id, run_uri, progress, index, after, purged, dropped, pending_n,
                       elapsed=time.monotonic() - t0, expand_s=t_graph - t_expand, graph_at=t_graph - t0,
                       timeline=timeline, failed_starts=failed)
    log.debug("sealed %d parts at the end", len(sealed))
    sink.write_summary(summary.to_json())
    sink.finish()
    if cfg.task.mode == "scan":
        stream.write(scan_line(summary) + "\n")
    return summary


def _expansion(source, done, plan, stream):
    """-> (tasks_ds, pending count, duplicates dropped, tally, known media). Resuming: what is left,
    counted first (tally and known None). Fresh: streamed into the graph, a `Tally` counting (counts None)."""
    import ray

    if len(done):  # resuming: count what is left first, and start nothing when that is nothing
        _say(stream, f"[vlbatch] resuming: {len(done)} rows already committed; counting what is left")
        # one object-store copy of the committed ids, mapped zero-copy by every expansion task
        tasks_ds = expanded(source, ray.put(done)).materialize()
        pending_n, dropped = count_pending(tasks_ds)
        return tasks_ds, pending_n, dropped, None, None
    tally = ray.remote(num_cpus=0, scheduling_strategy=driver_node())(Tally).remote()  # asked until the end
    return expanded(source, done, **STREAMED_EXPAND, tally=tally), None, None, tally, plan.media


def _say(stream, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()


def _summary(cfg, run_id, run_uri, progress, before, after, purged, dropped, pending_n, *, elapsed, expand_s,
             graph_at, timeline=None, failed_starts=()):
    total = sum(after.status_counts.values())
    errors = after.status_counts.get("error", 0)
    rates = progress.rates()
    skipped = len(before.done_ids) if cfg.resume.retry_transient else len(before.done_ids | before.transient_ids)
    return RunSummary(
        run_id=run_id, output_dir=run_uri, requests_pending=pending_n, requests_skipped=skipped,
        processed_by_status=dict(progress.status), error_types=dict(progress.error_types),
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
        files_written=len(set(after.files) - set(before.files)),
        stage_seconds={k: round(v, 3) for k, v in progress.stage_s.items()},
        prompt_tokens=progress.prompt_tokens, visual_tokens=progress.visual_tokens,
        token_histogram={"prompt": dict(progress.prompt_hist), "visual": dict(progress.visual_hist)},
        timeline=timeline.to_json() if timeline is not None else {}, failed_starts=list(failed_starts))
