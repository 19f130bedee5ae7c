"""What a run says before its first row: the plan, printed at once (before Ray starts).

`plan_run(cfg)` opens the run's `Source` (driver-side listing only, no Ray) and counts the
input when the source knows it without reading rows (`Source.count()`: Parquet footers, a
glob's matches), so the total and the ETA are known from the first progress line.
`RunPlan.line()` is the plan line: the input count, each actor pool and what the pools
reserve at their minimum sizes, e.g.

    [vlbatch] plan: 400 media -> 800 requests from /data/m.parquet; pools: decode+preprocess
    1-2 x 1 CPU, model 1 x 1 CPU + 0 GPU, write 1-4 x 0.25 CPU; reserves 2.30 CPUs, 0 GPUs

`jobs/local.py` prints it before connecting to Ray and hands the plan to `run_job` (which
reuses its source, so a large listing is made once); `run_job` without a plan prints it itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from vlbatch.pipeline.config import JobConfig


@dataclass(frozen=True)
class RunPlan:
    cfg: JobConfig
    source: object  # the run's `Source` (pipeline/sources)
    media: int | None  # manifest rows / glob matches (input.limit applied); None: counted while read
    requests: int | None  # output rows when every media's request count is fixed by the config
    cluster: object = None  # the `Cluster` (pipeline/resources) the plan was checked against; None: not yet

    def line(self) -> str:
        what = "input counted as it is read" if self.media is None else f"{self.media} media"
        if self.media is not None and self.requests is not None and self.requests != self.media:
            what += f" -> {self.requests} requests"
        return f"[vlbatch] plan: {what} from {self.cfg.input.uri}; {pools_text(self.cfg, self.cluster)}"


def plan_run(cfg: JobConfig, cluster=None) -> RunPlan:
    """The run's plan; `cluster`: the `Cluster` it runs on when known (a new local Ray), so the GPUs it
    reserves are resolved as `vlbatch validate` resolves them (`resources.model_gpus`)."""
    from vlbatch.pipeline.stages.expansion import requests_per_media
    from vlbatch.pipeline.sources import open_source

    source = open_source(cfg)
    media = source.count()
    k = requests_per_media(cfg)
    return RunPlan(cfg, source, media, None if media is None or k is None else media * k, cluster)


def _pool(name: str, stage, ranks: int = 1, gpus: float | None = None) -> tuple[str, float, float]:
    """(text, CPUs reserved, GPUs reserved) of one actor pool at its minimum size."""
    size = f"{stage.min_actors}" if stage.min_actors == stage.max_actors else f"{stage.min_actors}-{stage.max_actors}"
    per = f"{stage.num_cpus:g} CPU" + (f" + {gpus:g} GPU" if gpus is not None else "")
    if ranks > 1:
        per = f"{ranks} ranks x {per}"
    return (f"{name} {size} x {per}", stage.num_cpus * stage.min_actors * ranks,
            (gpus or 0.0) * stage.min_actors * ranks)


def pools_text(cfg: JobConfig, cluster=None) -> str:
    """The actor pools and what they reserve at min_actors (the manifest read's CPUs included). On a
    known `cluster` the model's GPUs as the run resolves them there (`device: auto` without a GPU: 0,
    `resources.model_gpus`: the figure `vlbatch validate` prints); else as configured."""
    from vlbatch.pipeline.stages.expansion import STREAMED_EXPAND
    from vlbatch.pipeline.plan.cluster import model_gpus

    r = cfg.resources
    if cfg.task.mode == "scan":
        pools = [_pool("decode+preprocess+write (scan)", r.preprocess)]
    else:
        pools = [_pool("decode+preprocess", r.preprocess)] if r.fuse_cpu_stages else \
            [_pool("decode", r.decode), _pool("preprocess", r.preprocess)]
        gpus = r.model.num_gpus if cluster is None else model_gpus(cfg, cluster)
        pools += [_pool("model", r.model, cfg.model.tensor_parallel_size, gpus), _pool("write", r.write)]
    cpus = sum(p[1] for p in pools) + STREAMED_EXPAND["num_cpus"]
    gpus = sum(p[2] for p in pools)
    return f"pools: {', '.join(p[0] for p in pools)}; reserves {cpus:.2f} CPUs, {gpus:g} GPUs"
