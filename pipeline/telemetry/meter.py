"""What the stages tell the driver while a run goes on, before and between commits.

`Meter` is a small Ray actor (no CPU) holding counters the stages add to: requests decoded,
preprocessed and generated (a media row counts its requests, so every figure is in output
rows), and actors ready (`cpu_ready`, `model_ready`: a model actor has loaded its model).
A stage holds a `MeterClient` (`meter=None`: a stage run outside the runner, nothing is
sent): increments are summed locally and sent when `every_s` has passed since the last send
or when the stage calls `flush` (the CPU stages at the end of each call, the model stage at
the end of each call and from its engine thread at most every `every_s`). The
model stage counts a request as generated when the engine finishes it (the `EngineLoop`'s
`on_finished` hook), not when its Ray batch returns. The driver adds each committed stats block
(`metrics.committed_counts`: rows, error rows by type, tokens). A model actor also sends its
occupancy (`report_model`: a `ModelReport`), split here by what the run held at that moment
(`pipeline/telemetry/occupancy.py`). With `ray.metrics` on, the meter exports its counts to Ray's
metrics (`pipeline/telemetry/metrics.py` `MeterMetrics`) as they arrive.

`Ticker` is the driver's side: a thread that, every progress interval (0.2 s on a
terminal), reads the meter and the expansion's `Tally` and has `Progress` print, so lines
come at the configured interval whether or not anything was committed. The counters are
figures for people (progress, phases); nothing is decided from them, and a lost increment
(an actor killed between two sends) only makes a figure low.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

log = logging.getLogger("vlbatch.pipeline")

DECODED, PREPROCESSED, GENERATED = "decoded", "preprocessed", "generated"
CPU_READY, MODEL_READY = "cpu_ready", "model_ready"
# video.clips: media rows the CPU stage has finished (a video once its last clip is out), clips it emitted
MEDIA_CUT, CLIPS = "media_cut", "clips"
CLIP_FRAMES, CLIP_VISUAL = "clip_frames", "clip_visual_tokens"  # the clips' sampled frames; visual tokens (scan)
MODEL_OCCUPANCY, CPU_WINDOW_S = "model_occupancy", "cpu_window_s"  # snapshot keys that are no counts


class Meter:
    """Ray actor: counters summed over every stage's sends, and each model actor's occupancy.

    `snapshot()` -> the counts, plus `MODEL_OCCUPANCY` ({actor: `ActorOccupancy`}) once a model actor
    reported and `CPU_WINDOW_S` (seconds since the first CPU actor was ready, on this actor's clock)."""

    def __init__(self, metrics=None, clock=time.monotonic):
        self.counts: Counter = Counter()
        self.models: dict = {}  # actor -> ActorOccupancy
        self.clock = clock
        self.cpu_since: float | None = None
        self.exporter = None
        if metrics is not None:  # a MetricTags: export to Ray's metrics
            from vlbatch.pipeline.telemetry.metrics import MeterMetrics

            self.exporter = MeterMetrics(metrics)

    def add(self, counts: dict) -> None:
        self.counts.update(counts)
        if self.cpu_since is None and self.counts.get(CPU_READY):
            self.cpu_since = self.clock()
        if self.exporter is not None:
            try:
                self.exporter.export(self.counts)
            except Exception as e:  # noqa: BLE001 - a figure for people: never lose the counts for it
                log.debug("metrics export failed: %s", e)

    def report_model(self, report) -> None:
        """A model actor's cumulative `ModelReport`; its new idle seconds split by the rows waiting now."""
        from vlbatch.pipeline.telemetry.metrics import queue_depths
        from vlbatch.pipeline.telemetry.occupancy import ActorOccupancy

        waiting = queue_depths(self.counts)["model"]
        known = self.models.get(report.actor)
        self.models[report.actor] = (ActorOccupancy.first(report, waiting) if known is None
                                     else known.add(report, waiting))

    def snapshot(self) -> dict:
        out = dict(self.counts)
        if self.models:
            out[MODEL_OCCUPANCY] = dict(self.models)
        if self.cpu_since is not None:
            out[CPU_WINDOW_S] = self.clock() - self.cpu_since
        return out


class MeterClient:
    """A stage's side of the meter (thread-safe: the model stage adds from its engine thread)."""

    def __init__(self, handle, every_s: float = 1.0, clock=time.monotonic):
        self.handle, self.every_s, self.clock = handle, every_s, clock
        self._lock = threading.Lock()
        self._pending: Counter = Counter()
        self._sent_at = clock()

    def add(self, key: str, n: int = 1) -> None:
        if self.handle is None or not n:
            return
        with self._lock:
            self._pending[key] += n
            due = self.clock() - self._sent_at >= self.every_s
        if due:
            self.flush()

    def flush(self) -> None:
        if self.handle is None:
            return
        with self._lock:
            counts, self._pending = dict(self._pending), Counter()
            self._sent_at = self.clock()
        if counts:
            try:
                self.handle.add.remote(counts)
            except Exception as e:  # noqa: BLE001 - a figure for people: never fail a stage for it
                log.debug("meter send failed: %s", e)

    def report(self, report) -> None:
        """A model actor's occupancy (`ModelReport`), sent at once."""
        if self.handle is None:
            return
        try:
            self.handle.report_model.remote(report)
        except Exception as e:  # noqa: BLE001 - a figure for people
            log.debug("meter report failed: %s", e)

    def ready(self, key: str) -> None:
        """Say at once that this actor is ready (`CPU_READY` / `MODEL_READY`)."""
        self.add(key)
        self.flush()


def driver_node():
    """A scheduling strategy pinning an actor to the driver's node: the run's own small actors (`Meter`,
    the expansion's `Tally`, `placement.StartFailures`), which the driver asks until the run ends, so a
    lost worker node never takes them (left to Ray, a 0-CPU actor may land on any node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def start_meter(metrics=None):
    """A new `Meter` actor for one run, on the driver's node (no CPU: it runs beside full actor pools);
    `metrics`: the run's `MetricTags` (export to Ray's metrics) or None."""
    import ray

    return ray.remote(num_cpus=0, scheduling_strategy=driver_node())(Meter).remote(metrics)


class Ticker:
    """The driver's progress thread: every `every_s` it reads the meter (and the tally, until
    the total is known) and lets `progress` print. `with Ticker(...):` around the graph."""

    def __init__(self, progress, meter, tally=None, known: int | None = None, every_s: float = 1.0,
                 timeline=None):
        self.progress, self.meter, self.tally, self.known, self.every_s = progress, meter, tally, known, every_s
        self.timeline = timeline  # gets the model actors' stepping / waiting seconds (`Timeline.observe_model`)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlbatch-progress", daemon=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()  # the last figures before the final line

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
                self.progress.tick()
            except Exception as e:  # noqa: BLE001 - progress must never stop a run
                log.debug("progress tick failed: %s", e)

    def poll(self) -> None:
        import ray

        if self.meter is not None:
            ready, _ = ray.wait([ref := self.meter.snapshot.remote()], timeout=5)
            if ready:
                counts = ray.get(ref)
                self.progress.observe(counts)
                if self.timeline is not None and (models := counts.get(MODEL_OCCUPANCY)):
                    self.timeline.observe_model(sum(a.report.busy_s for a in models.values()),
                                                sum(a.input_s + a.output_s for a in models.values()))
        if self.tally is not None and self.known is not None:
            ready, _ = ray.wait([ref := self.tally.get.remote()], timeout=5)
            if ready:
                media, requests, _ = ray.get(ref)
                if media >= self.known:  # every manifest row expanded: the exact total
                    self.progress.set_total(requests)
                    self.tally = None
