"""vlbatch's series in Ray's own metrics system (`ray.util.metrics`), on every node's Prometheus endpoint.

Tagged `job` (the job name: the config file's stem, `--name`) and `run_id` (`MetricTags`). Ray's agent
exports a metric named `vlbatch_x` as `ray_vlbatch_x`, a counter with `_total` appended (`SERIES`: the
names as scraped; `infra/grafana/vlbatch.json` queries only those). Off with `ray.metrics: false`.

Counters are exported by the `Meter` actor (`MeterMetrics.export`: each new count as `Counter.inc(delta)`),
from the counts every stage already sends it and the committed stats blocks the driver adds, so a
counter's final value is the run's own figure (`_summary.json`):

- `vlbatch_rows{stage}`: requests decoded / preprocessed / generated / committed (`stage`);
- `vlbatch_errors{error_type}`: committed error rows by type;
- `vlbatch_tokens{kind}`: prompt / visual / generated / cached (prefix cache hits) tokens of committed rows;
- `vlbatch_vision_cache{result}`: media looked up in the vision cache: `hit` / `encode`;
- `vlbatch_quality_flags{flag}`: committed ok answers per quality flag (`operators/quality.py`);
- `vlbatch_queue_depth{stage}` (gauge): requests waiting for `stage` (preprocess, model, write): the
  rows one stage produced that the next one has not taken (or, for write, not committed).

Per model actor (`ModelMetrics`, recorded in the actor): `vlbatch_model_call_seconds` (histogram, one
model-stage call), `vlbatch_model_busy_fraction` (gauge: engine stepping / the actor's window,
`pipeline/telemetry/occupancy.py`).

Final values: a process's series reach the endpoint only when Ray exports them, every
`metrics_report_interval_ms` (`export_interval_s`; Ray's default 10 s, a new local Ray of `vlbatch run`
2 s: `jobs/connect.py`), and the run's actors die with its driver (a local Ray, and its endpoint, with
them). So when the graph ends the driver waits (`wait_exported`) until the endpoint of its node (where the
`Meter` runs) shows the run's final committed count, and at least one export interval, so the model
actors' last figures are out too; bounded (`3 x` the interval + 5 s), whatever the endpoint does.
"""
from __future__ import annotations

import logging
import re
import time
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("vlbatch.pipeline")

ROWS, ERRORS, TOKENS, VISION = "vlbatch_rows", "vlbatch_errors", "vlbatch_tokens", "vlbatch_vision_cache"
QUALITY = "vlbatch_quality_flags"
QUEUE, CALL_S, BUSY = "vlbatch_queue_depth", "vlbatch_model_call_seconds", "vlbatch_model_busy_fraction"
# the names Ray's Prometheus endpoint shows (prefix ray_, counters _total, a histogram its three series)
SERIES = (*(f"ray_{n}_total" for n in (ROWS, ERRORS, TOKENS, VISION, QUALITY)), f"ray_{QUEUE}", f"ray_{BUSY}",
          *(f"ray_{CALL_S}_{s}" for s in ("bucket", "count", "sum")))
TAG_KEYS = ("job", "run_id")
CALL_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 600]

# meter count key -> (counter name, its extra tag)
COMMITTED, MODEL_IN = "committed", "model_in"
_ROW_KEYS = {"decoded": "decoded", "preprocessed": "preprocessed", "generated": "generated", COMMITTED: "committed"}
TOKEN_KEYS = {"prompt_tokens": "prompt", "visual_tokens": "visual", "generated_tokens": "generated",
              "cached_tokens": "cached"}
VISION_KEYS = {"vision_hits": "hit", "vision_encodes": "encode"}
ERROR_PREFIX = "error:"  # a meter key `error:<type>` counts committed error rows of that type
QUALITY_PREFIX = "quality:"  # a meter key `quality:<flag>` counts committed ok answers with that flag


@dataclass(frozen=True)
class MetricTags:
    """The tags of every vlbatch series of one run."""

    job: str
    run_id: str

    def tags(self, **extra: str) -> dict:
        return {"job": self.job, "run_id": self.run_id, **extra}


def committed_counts(stats) -> dict:
    """A committed stats block (`write_stage.STATS_SCHEMA` table) -> meter counts: rows, error rows by
    type, tokens, vision cache lookups."""
    d = stats.to_pydict()
    out = {COMMITTED: stats.num_rows}
    for t in d["error_type"]:
        if t:
            out[ERROR_PREFIX + t] = out.get(ERROR_PREFIX + t, 0) + 1
    for k in (*TOKEN_KEYS, *VISION_KEYS):
        out[k] = sum(x or 0 for x in d.get(k, []))
    for flags in d.get("quality_flags", []):
        for f in flags or ():
            out[QUALITY_PREFIX + f] = out.get(QUALITY_PREFIX + f, 0) + 1
    return out


class MeterMetrics:
    """The `Meter`'s exporter: cumulative counts -> counter increments (the new part only) and queue gauges."""

    def __init__(self, tags: MetricTags):
        from ray.util.metrics import Counter, Gauge

        self.t = tags
        self.rows = Counter(ROWS, "requests through each stage", tag_keys=(*TAG_KEYS, "stage"))
        self.errors = Counter(ERRORS, "committed error rows by type", tag_keys=(*TAG_KEYS, "error_type"))
        self.tokens = Counter(TOKENS, "tokens of committed rows by kind", tag_keys=(*TAG_KEYS, "kind"))
        self.vision = Counter(VISION, "vision cache lookups by result", tag_keys=(*TAG_KEYS, "result"))
        self.quality = Counter(QUALITY, "committed ok answers by quality flag", tag_keys=(*TAG_KEYS, "flag"))
        self.queue = Gauge(QUEUE, "requests waiting for a stage", tag_keys=(*TAG_KEYS, "stage"))
        self.sent: dict = {}

    def export(self, counts: dict) -> None:
        # committed last: once the endpoint shows its final value, every count of the same call is out too
        # (`wait_exported`)
        for key, n in sorted(counts.items(), key=lambda kv: kv[0] == COMMITTED):
            delta = n - self.sent.get(key, 0)
            if delta <= 0:
                continue
            self.sent[key] = n
            if key in _ROW_KEYS:
                self.rows.inc(delta, tags=self.t.tags(stage=_ROW_KEYS[key]))
            elif key in TOKEN_KEYS:
                self.tokens.inc(delta, tags=self.t.tags(kind=TOKEN_KEYS[key]))
            elif key in VISION_KEYS:
                self.vision.inc(delta, tags=self.t.tags(result=VISION_KEYS[key]))
            elif key.startswith(ERROR_PREFIX):
                self.errors.inc(delta, tags=self.t.tags(error_type=key.removeprefix(ERROR_PREFIX)))
            elif key.startswith(QUALITY_PREFIX):
                self.quality.inc(delta, tags=self.t.tags(flag=key.removeprefix(QUALITY_PREFIX)))
        for stage, n in queue_depths(counts).items():
            self.queue.set(n, tags=self.t.tags(stage=stage))


def queue_depths(counts: dict) -> dict:
    """Requests waiting for each stage: produced by the one before, not yet taken (write: not committed).
    With the CPU stages fused nothing waits between decode and preprocess (the counts move together)."""
    c = counts.get
    return {"preprocess": max(0, c("decoded", 0) - c("preprocessed", 0)),
            "model": max(0, c("preprocessed", 0) - c(MODEL_IN, 0)),
            "write": max(0, c("generated", 0) - c(COMMITTED, 0))}


class ModelMetrics:
    """A model actor's own series: each call's latency, its busy fraction."""

    def __init__(self, tags: MetricTags):
        from ray.util.metrics import Gauge, Histogram

        self.t = tags.tags()
        self.call_s = Histogram(CALL_S, "seconds of one model-stage call", boundaries=CALL_BOUNDARIES,
                                tag_keys=TAG_KEYS)
        self.busy = Gauge(BUSY, "engine stepping / the model actor's window", tag_keys=TAG_KEYS)

    def call(self, seconds: float) -> None:
        self.call_s.observe(seconds, tags=self.t)

    def busy_fraction(self, value: float) -> None:
        self.busy.set(value, tags=self.t)


def export_interval_s() -> float:
    """How often each Ray process exports its metrics: `metrics_report_interval_ms`, at least 1 s as Ray does."""
    import ray

    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000


def node_endpoint() -> str | None:
    """The metrics endpoint of the driver's node (`http://IP:PORT/metrics`; None: it has none)."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n.get("NodeID") == me and n.get("MetricsExportPort"):
            return f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
    return None


def exported_committed(url: str, tags: MetricTags) -> float | None:
    """The run's `vlbatch_rows{stage="committed"}` as `url` shows it now (None: not there, or no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return None
    want = ('stage="committed"', f'run_id="{tags.run_id}"', f'job="{tags.job}"')
    values = [float(m.group(1)) for line in text.splitlines()
              if line.startswith(f"ray_{ROWS}_total{{") and all(w in line for w in want)
              and (m := re.search(r"\}\s+(\S+)", line))]
    return sum(values) if values else None


def wait_exported(meter, tags: MetricTags, clock=time.monotonic, poll_s: float = 0.25) -> float:
    """Wait until the run's final counts are on its node's endpoint (module docstring); the seconds waited."""
    import ray

    t0, period = clock(), export_interval_s()
    try:  # asked after every count this driver sent (one caller's calls run in order): the final figures
        want = ray.get(meter.snapshot.remote(), timeout=60).get(COMMITTED, 0)
    except Exception as e:  # noqa: BLE001 - figures for people: the run's end never waits on them
        log.warning("the run's final metrics are unknown: %s", e)
        return clock() - t0
    url = node_endpoint() if want else None
    seen = None
    while clock() - t0 < 3 * period + 5:
        if clock() - t0 >= period and (url is None or (seen is not None and seen >= want)):
            return clock() - t0
        time.sleep(poll_s)
        seen = exported_committed(url, tags) if url else None
    log.warning("the run's final metrics were not seen on %s after %.0f s", url, clock() - t0)
    return clock() - t0
