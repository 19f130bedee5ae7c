"""`run_job(plan) -> RunSummary`: the checked plan's stages as one Ray Data graph, manifest to committed output.

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

Output: the run's sink (`plan.sink.open_sink`, at `<output.uri>/<run_id>`, opened with its index read by
`startup/nothing_to_do.open_run` before Ray starts and handed in; Parquet: rolling
part files and `_summary.json` beside them; `sink.seal()` after the graph publishes what the
writers still held). Only the sink contract is used here
(`vlbatch.operators.sink.base`): before the graph starts its committed index is read:
committed ok / permanent-error rows are skipped, transient error rows purged and redone.
After it finishes the index is read again to count the whole run (all attempts), and the
sink's `finish()` drops what the commits left behind (an empty `_tmp/`).

The stages are the checked plan's (`plan/spec.RunPlan.stages`, one loop in `build_graph`); what
would fail later was refused before (`plan/preflight.py`: an output bucket that does not exist,
answers of another config under the run id, pools that cannot all start on a local Ray): `run_job`
checks nothing again. An actor that fails to start on a node (a model replica whose
checkpoint cache there is unwritable): its pool avoids that node and the run goes on
(`RunSummary.failed_starts`), or stops in one line when no node is left (`pipeline/startup/placement.py`).
"""
from __future__ import annotations

import importlib
import logging
import sys
import time
from dataclasses import replace

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.storage import replace_file
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.plan.fingerprint import FINGERPRINT_NAME, check_fingerprint
from vlbatch.pipeline.plan.sink import open_sink
from vlbatch.pipeline.plan.spec import RunPlan, StageSpec
from vlbatch.pipeline.stages.engine_rate import scan_busy
from vlbatch.pipeline.stages.expansion import Tally, count_pending, expanded
from vlbatch.pipeline.stages.scan import cpu_s_per_request, scan_line
from vlbatch.pipeline.startup.placement import INIT_DEATHS
from vlbatch.pipeline.telemetry.attempts import with_attempts
from vlbatch.pipeline.telemetry.meter import driver_node
from vlbatch.pipeline.telemetry.progress import Progress
from vlbatch.pipeline.telemetry.summary import RunSummary, summarize
from vlbatch.pipeline.telemetry.timeline import Timeline

log = logging.getLogger("vlbatch.pipeline")


def _init_ray(cfg: JobConfig, block_size: int) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, log_to_driver=False, logging_level=logging.WARNING,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    # an actor that dies while starting is replaced (Ray Data's default, 0, fails the run at once): one
    # that cannot start on a node is retried off that node (pipeline/startup/placement.py)
    ctx.max_consecutive_actor_init_deaths = INIT_DEATHS
    # A CPU-stage task emits its output (pixel values) in blocks of up to this size, and a
    # model task takes whole blocks: with Ray Data's default (128 MiB, ~100 media of a few
    # hundred visual tokens) the model stage took ~100 media per task and committed them only
    # at its end (first commit after minutes). 16 MiB: a few media per block.
    ctx.target_max_block_size = block_size  # the plan's (`plan/spec.block_bytes`)


def _load(target: str) -> type:
    """The stage class a spec names ("module:attr")."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _map(ds, spec: StageSpec, runtime: dict, failures):
    """One actor stage of the plan on `ds`: its class, kwargs (the plan's, then the named run-time ones),
    batch size and resources (the actor pool at min..max actors)."""
    import ray

    from vlbatch.pipeline.startup.placement import map_stage

    compute = ray.data.ActorPoolStrategy(min_size=spec.pool.min_actors, max_size=spec.pool.max_actors,
                                         **spec.strategy)
    kwargs = {**spec.kwargs, **{k: runtime[k] for k in spec.runtime}}
    return map_stage(ds, _load(spec.target), failures, fn_constructor_kwargs=kwargs,
                     batch_size=spec.batch_size, batch_format="pyarrow", compute=compute, **spec.ray_args())


def build_graph(plan: RunPlan, tasks_ds, run_dir: str, run_id: str, meter=None, failures=None, metrics=None,
                done=None):
    """The lazy dataset of write stats rows: the plan's stages over `tasks_ds`, in order (`run_dir`: the
    run's URI, where its sink is; `meter`: the run's `Meter` actor the stages count into,
    pipeline/telemetry/meter.py; `failures`: its `RunPlacement`: failed starts and each pool's
    resources, pipeline/startup/placement.py; `metrics`: the run's `MetricTags`, None: no Ray metrics;
    `done`: the committed ids' ObjectRef, for a CPU stage that cuts clips, `video.clips`)."""
    runtime = {"meter": meter, "run_dir": run_dir, "run_id": run_id, "metrics": metrics, "done": done}
    ds = tasks_ds
    for spec in plan.stages:
        ds = _map(ds, spec, runtime, failures)
    return ds


def _stream_graph(plan: RunPlan, tasks_ds, sink, run_id: str, progress: Progress, tally,
                  known: int | None, timeline: Timeline, job: str, done_ref=None) -> tuple[list[str], str | None]:
    """Run the graph, feeding its stats rows to `progress`; a `Ticker` thread reads the meter (and the
    tally until `known` media are read) and prints progress meanwhile, committed rows or not. -> (the
    start failures the run went on without (`placement.failed_lines`), the line naming the nodes it lost
    and went on without, or None); a pool's nodes all lost: `watching_nodes` stops the run."""
    from vlbatch.pipeline.startup.node_loss import watching_nodes
    from vlbatch.pipeline.startup.placement import RunPlacement, failed_lines, start_failures
    from vlbatch.pipeline.telemetry.meter import Ticker, start_meter
    from vlbatch.pipeline.telemetry.metrics import MetricTags, committed_counts, wait_exported

    cfg = plan.cfg
    metrics = MetricTags(job, run_id) if cfg.ray.metrics else None
    meter, placement = start_meter(metrics), RunPlacement(start_failures())
    graph = build_graph(plan, tasks_ds, sink.uri, run_id, meter=meter, failures=placement, metrics=metrics,
                        done=done_ref)
    progress.set_phase("starting the actors and loading the model" if cfg.task.mode != "scan" else
                       "starting the actors", sticky=cfg.task.mode != "scan")
    every = 0.2 if progress.tty else min(1.0, cfg.ray.progress_interval_s)
    with (Ticker(progress, meter, tally, known, every_s=every, timeline=timeline),
          watching_nodes(placement, cfg.ray) as watch):
        # prefetch_batches=0: each stats block as soon as it exists (prefetching holds one back)
        for stats in graph.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=0):
            meter.add.remote(committed_counts(stats))  # committed rows, errors, tokens: the meter's metrics
            progress.update(stats)
            timeline.update(stats)
    if metrics is not None:  # the final values on the endpoint before the run lets go of Ray (metrics.py)
        log.debug("final metrics exported after %.1f s", wait_exported(meter, metrics))
    return failed_lines(placement.failures), watch.seen.line()


def _open_run(plan: RunPlan, opened=None):
    """(sink, index before the run, transient rows purged, committed ids to skip); `opened`: the sink and
    index `startup/nothing_to_do.open_run` read before Ray started (None: opened here). The plan's fingerprint
    note is written once the sink's folder is prepared."""
    cfg, run = plan.cfg, plan.run
    if cfg.output.clip_files is not None:  # a killed clip writer's temp files (no worker writes yet)
        from vlbatch.operators.media.clip_files import clean_debris, clip_folders

        for folder in clip_folders(run.run_uri):
            clean_debris(folder, run.storage)
    if opened is not None and opened.sink is not None:
        sink, index = opened.sink, opened.index
        sink.prepare()
    else:
        sink = open_sink(cfg, run.run_uri, run.storage, plan.source)
        sink.prepare()
        index = sink.index(max_tokens=cfg.sampling.max_tokens)  # TruncatedError rows a larger max_tokens redoes
    if index.files and not cfg.resume.enabled:
        raise ConfigError(f"resume.enabled=false but {run.run_uri} already holds {len(index.files)} committed files; "
                          "set resume.enabled=true to continue that run or choose a new output.run_id")
    purged = sink.purge(index.purgeable_ids, max_tokens=cfg.sampling.max_tokens) if cfg.resume.retry_transient else 0
    done = index.done_ids if cfg.resume.retry_transient else index.done_ids | index.transient_ids
    note = run.fingerprint if run.fingerprint is not None else check_fingerprint(cfg, run.run_id, run.storage)
    if (opened is None or opened.sink is None) and note.missing and index.files:  # else `open_run` said so
        log.warning("run %s holds rows but no %s (made before fingerprints): its config is taken as this one",
                    run.run_id, FINGERPRINT_NAME)
    replace_file(note.uri, note.data, run.storage)
    return sink, index, purged, done


def _checked(job: RunPlan | JobConfig, stream) -> RunPlan:
    """A `JobConfig` (an in-process caller: tests, benchmarks) goes through the one preflight first, on
    the running Ray (or this machine when none runs yet), and its plan line is printed; a `RunPlan` is
    the caller's, checked and printed already (`jobs/local.py`)."""
    if isinstance(job, RunPlan):
        return job
    import ray

    from vlbatch.pipeline.plan.cluster import joined_cluster, local_cluster
    from vlbatch.pipeline.plan.preflight import preflight

    plan = preflight(job, joined_cluster("the running Ray") if ray.is_initialized() else local_cluster())
    _say(stream, plan.line())
    return plan


def run_job(job: RunPlan | JobConfig, *, stream=None, name: str | None = None, opened=None) -> RunSummary:
    """Run (or resume) a job to completion; returns its summary, also written as `_summary.json`.
    `job`: the run's checked `RunPlan` (`plan/preflight.py`), run as it is: nothing is checked again;
    a `JobConfig`: checked here first by the same preflight (`_checked`). `name`: the job's name, the
    `job` tag of its Ray metrics (default: the run id). `opened`: the sink and committed index read before Ray
    started (`startup/nothing_to_do.open_run`; None: read here)."""
    import ray

    stream = stream or sys.stderr
    t0 = time.monotonic()
    plan = _checked(job, stream)
    cfg, run_id = plan.cfg, plan.run.run_id
    sink, index, purged, done = _open_run(plan, opened)

    if not ray.is_initialized():
        _say(stream, "[vlbatch] starting Ray")
    _init_ray(cfg, plan.block_bytes)
    t_expand = time.monotonic()
    tasks_ds, pending_n, dropped, tally, known = _expansion(plan, done, stream)
    # video.clips: a clip's ids are made when the CPU stage cuts the video, so it drops committed clips there
    done_ref = ray.put(done) if cfg.video.clips.mode != "none" and len(done) else None
    del done  # the driver keeps only its length (below) and the index
    t_graph = time.monotonic()
    models = next((s.pool.min_actors for s in plan.stages if s.name == "model"), None)
    # video.clips: the rows (one per clip and prompt) are counted only as videos are cut; the total is in media
    clipped = cfg.video.clips.mode != "none"
    media_total = (plan.media if pending_n is None else tasks_ds.count()) if clipped else None
    progress = Progress(total=None if clipped else pending_n if pending_n is not None else plan.requests,
                        stream=stream, interval_s=cfg.ray.progress_interval_s, expect_models=models,
                        clipped=clipped, media_total=media_total)
    timeline, failed, lost = Timeline(), [], None
    if pending_n is None or pending_n:
        try:
            failed, lost = _stream_graph(plan, tasks_ds, sink, run_id, progress, tally, None if clipped else known,
                                         timeline, name or run_id, done_ref)
        except BaseException as stop:  # Ctrl-C / SIGTERM (jobs/stops.py), a failure: an attempt all the same
            _record_stopped(plan, sink, progress, index, purged, pending_n, timeline, stop, t0=t0,
                            expand_s=t_graph - t_expand, graph_at=t_graph - t0)
            raise
    for line in failed:
        _say(stream, f"[vlbatch] an actor failed to start: {line}; the run went on without that node")
    if lost:
        _say(stream, lost)
    return _finish(plan, sink, progress, index, purged, dropped, pending_n, tally, timeline, failed, stream,
                   t0=t0, expand_s=t_graph - t_expand, graph_at=t_graph - t0)


def _finish(plan, sink, progress, index, purged, dropped, pending_n, tally, timeline, failed, stream, *, t0,
            expand_s, graph_at) -> RunSummary:
    """After the graph: seal what writers still held, count the whole run, write `_summary.json`."""
    import ray

    cfg = plan.cfg
    progress.set_phase(None)
    policy = cfg.output.roll_policy()
    sealed = sink.seal(policy.target_rows, policy.target_bytes)  # what writers still held at the end
    if tally is not None:
        dropped = ray.get(tally.get.remote())[2]
    elif dropped is None:  # nothing reached the writer: no duplicate was dropped either
        dropped = 0
    if pending_n is None or cfg.video.clips.mode != "none":  # the graph completed: a stats row per pending request
        # (clipped: `pending_n` counted the videos' requests, not their clips')
        pending_n = progress.total = progress.done
    progress.tick(final=True)
    after = sink.index()
    summary = summarize(cfg, plan.run.run_id, plan.run.run_uri, progress, index, after, purged,
                        dropped, pending_n, elapsed=time.monotonic() - t0, expand_s=expand_s, graph_at=graph_at,
                        timeline=timeline, failed_starts=failed)
    log.debug("sealed %d parts at the end", len(sealed))
    summary = with_attempts(summary, sink.read_summary())  # the earlier calls' records, kept
    sink.write_summary(summary.to_json())
    sink.finish()
    if cfg.task.mode == "scan":
        stream.write(scan_line(summary, progress.counts, scan_busy(cfg, summary, cpu_s_per_request(summary))) + "\n")
    return summary


def _record_stopped(plan, sink, progress, index, purged, pending_n, timeline, stop, *, t0, expand_s,
                    graph_at) -> None:
    """A call stopped mid-run (`stop`: `Interrupted`, KeyboardInterrupt, a failure) writes `_summary.json`
    too, its attempt marked "interrupted" / "failed" (`telemetry/attempts.py`): the rows its writers took
    (staged, published by the stop's tidy-up or the next start), its seconds and its timeline, so a resume
    lists it. Best effort: a summary that cannot be written leaves the stop as it was."""
    cfg = plan.cfg
    try:
        progress.set_phase(None)
        total = pending_n if pending_n is not None else max(progress.total or 0, progress.done)
        summary = summarize(cfg, plan.run.run_id, plan.run.run_uri, progress, index, sink.index(), purged, None,
                            total, elapsed=time.monotonic() - t0, expand_s=expand_s, graph_at=graph_at,
                            timeline=timeline)
        by_status = summary.processed_by_status
        timeline.settle(sum(by_status.values()), by_status.get("error", 0))
        summary = replace(summary, timeline=timeline.to_json())
        ended = "failed" if isinstance(stop, Exception) else "interrupted"
        sink.write_summary(with_attempts(summary, sink.read_summary(), ended=ended).to_json())
    except Exception as e:  # noqa: BLE001 - the stop is what the caller reports
        log.warning("the stopped call's attempt was not recorded in _summary.json: %s", e)


def _expansion(plan: RunPlan, done, stream):
    """-> (tasks_ds, pending count, duplicates dropped, tally, known media): the plan's read. Resuming:
    what is left, counted first (tally and known None). Fresh: streamed into the graph, a `Tally`
    counting (counts None)."""
    import ray

    source = plan.source  # one per run: its listing and first schema were read once, by the preflight
    if len(done):  # resuming: count what is left first, and start nothing when that is nothing
        _say(stream, f"[vlbatch] resuming: {len(done)} rows already committed; counting what is left")
        # one object-store copy of the committed ids, mapped zero-copy by every expansion task
        tasks_ds = expanded(source, ray.put(done)).materialize()
        pending_n, dropped = count_pending(tasks_ds)
        return tasks_ds, pending_n, dropped, None, None
    tally = ray.remote(num_cpus=0, scheduling_strategy=driver_node())(Tally).remote()  # asked until the end
    read = plan.read.pool
    return (expanded(source, done, num_cpus=read.num_cpus, concurrency=read.max_actors, tally=tally), None, None,
            tally, plan.media)


def _say(stream, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()
