"""The run's one plan: `plan(cfg, cluster) -> RunPlan`, a list of `StageSpec`s (the layout exists only here).

    manifest read (tasks)  -> [decode -> preprocess | decode+preprocess] -> model -> write     (task.mode caption / qa)
    manifest read (tasks)  -> decode+preprocess+write (scan)                                 (task.mode scan)

Each `StageSpec` names its stage class ("module:attr", imported by the graph only), the constructor
kwargs the plan knows (`kwargs`) and the run-time objects the graph adds by name (`runtime`: the
`meter` actor, the sink's `run_dir`), its actor `Pool` (CPUs, GPUs, memory per rank, ranks, min..max
actors), its batch size, Ray's extra arguments (`strategy` for the actor pool) and the row types it
reads / produces (`pipeline/stages/rows.py`). Everything that asks what the run is reads this list:
the graph (`pipeline/graph.py`, one loop), the fit checks (`plan/fit.py`), the plan line `vlbatch run`
prints (`RunPlan.line`), the pools `vlbatch validate` prints (`RunPlan.pools_line`) and the progress
line's expected model actors. `model_gpus` (the GPUs a model rank gets on a cluster) is here, once.

`plan` opens the run's `Source` (driver-side listing only, no Ray) and counts the input when the
source knows it without reading rows (`Source.count()`: Parquet footers, a glob's matches), so the
total and the ETA are known from the first progress line. The plan line, e.g.

    [vlbatch] plan: 400 media -> 800 requests from /data/m.parquet; pools: decode+preprocess
    1-2 x 1 CPU, model 1 x 1 CPU + 0 GPU, write 1-4 x 0.25 CPU; reserves 2.30 CPUs, 0 GPUs
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vlbatch.operators.storage import StorageOptions, join
from vlbatch.pipeline.config import JobConfig, StageResources
from vlbatch.pipeline.plan.cluster import GIB, Cluster

# CPUs per read / expand task when they stream into the graph beside the actor pools (which hold most
# of the CPUs), and one such task at a time: expansion costs microseconds per media against the seconds
# the model spends on it, and every concurrent task is another worker process to start (about 1.5 CPU-s
# each) while the actors are starting. The materialised expansion of a resumed run keeps Ray's defaults.
READ_CPUS, READ_TASKS = 0.05, 1
SCAN_BATCH_SIZE = 256  # media per scan-actor call when resources.preprocess.batch_size is not set (`scan_batch_size`)
MIN_BLOCK_BYTES = 64 << 10
SCAN_BLOCK_BYTES = 512 << 10  # scan: ~1700 media rows a block (MediaTask / Generated; 64 KiB: 11 % slower at 200k)
_STAGES = "vlbatch.pipeline.stages"


@dataclass(frozen=True)
class Pool:
    """One stage's actors: `min_actors`..`max_actors` of `ranks` x (num_cpus, num_gpus, memory_bytes)
    each (a model replica's rank 0 holds every rank's share, `pipeline/backends/followers.py`), and so
    `actor_cpus`, `actor_gpus`, `actor_memory` per actor (`of`). `field`: the config section that
    sizes it (resources.<stage>; the read: "input (manifest read)")."""

    field: str
    num_cpus: float
    num_gpus: float
    memory_bytes: int
    min_actors: int
    max_actors: int
    ranks: int
    actor_cpus: float  # rounded to Ray's unit (1e-4): 3 x 0.1 is not 0.30000000000000004
    actor_gpus: float
    actor_memory: int

    @classmethod
    def of(cls, field: str, num_cpus: float, num_gpus: float = 0.0, memory_bytes: int = 0, min_actors: int = 1,
           max_actors: int = 1, ranks: int = 1) -> Pool:
        return cls(field, num_cpus, num_gpus, memory_bytes, min_actors, max_actors, ranks,
                   round(num_cpus * ranks, 4), round(num_gpus * ranks, 4), memory_bytes * ranks)


@dataclass(frozen=True)
class StageSpec:
    """One operator of the graph (see the module docstring)."""

    name: str  # as the plan line names it: decode, preprocess, decode+preprocess, model, write, ...
    target: str  # "module:attr" of the stage class
    pool: Pool
    batch_size: int | None
    kwargs: dict = field(default_factory=dict)  # constructor kwargs known to the plan
    runtime: tuple[str, ...] = ()  # constructor kwargs the graph adds: "meter", "metrics", "run_dir"
    strategy: dict = field(default_factory=dict)  # extra ActorPoolStrategy arguments
    reads: str = "MediaTask"  # the row type it takes (pipeline/stages/rows.py; "stats": write stats rows)
    produces: str = "stats"

    def ray_args(self) -> dict:
        """`map_batches`' resource arguments, without the actor pool (`compute`, made by the graph)."""
        out = {"num_cpus": self.pool.actor_cpus}
        if self.pool.actor_gpus:
            out["num_gpus"] = self.pool.actor_gpus
        if self.pool.actor_memory:
            out["memory"] = self.pool.actor_memory
        return out


def model_gpus(cfg: JobConfig, cluster: Cluster | None) -> float:
    """GPUs per model rank: `resources.model.num_gpus`, or 0 when `cluster` has no GPU, no autoscaler
    known to add one, and `model.device` is `auto` (the model then runs on CPU instead of waiting
    forever for a GPU: `cpu_fallback` says so; `plan/fit.py` refuses it on a joined cluster that can
    never get one). `device: cuda` keeps the request, for autoscaling clusters that add GPU nodes.
    `cluster` None (not known yet): as configured."""
    return 0.0 if cpu_fallback(cfg, cluster) else cfg.resources.model.num_gpus


def cpu_fallback(cfg: JobConfig, cluster: Cluster | None) -> bool:
    """Whether the model asked GPUs (`resources.model.num_gpus`, `model.device: auto`) but gets the CPU:
    `cluster` has none and no autoscaler known to add one."""
    return (cfg.resources.model.num_gpus > 0 and cfg.model.device == "auto" and cluster is not None
            and not cluster.gpus and cluster.may_add_gpus is not True)


def _pool(cfg: JobConfig, stage: str, *, gpus: float = 0.0, ranks: int = 1) -> Pool:
    s: StageResources = getattr(cfg.resources, stage)
    return Pool.of(f"resources.{stage}", s.num_cpus, gpus, int(s.memory_gb * GIB) if s.memory_gb else 0,
                s.min_actors, s.max_actors, ranks)


def read_spec() -> StageSpec:
    """The manifest read + expansion (Ray tasks, not actors: `pipeline/stages/expansion.expanded`)."""
    return StageSpec("input (manifest read)", f"{_STAGES}.expansion:expanded",
                     Pool.of("input (manifest read)", READ_CPUS, min_actors=READ_TASKS, max_actors=READ_TASKS),
                     None, reads="manifest", produces="MediaTask")


def stage_specs(cfg: JobConfig, cluster: Cluster | None, source=None) -> list[StageSpec]:
    """The actor stages in graph order (`source`: the run's `Source`, for the scan's batch size)."""
    r = cfg.resources
    # video.clips: the decode cuts each video into clips and drops the committed ones (their ids are made there)
    decode_rt = ("meter", "done") if cfg.video.clips.mode != "none" else ("meter",)
    if cfg.task.mode == "scan":  # no model: decode + preprocess -> scan rows -> written, in one CPU pool
        return [StageSpec("decode+preprocess+write (scan)", f"{_STAGES}.scan:ScanStage", _pool(cfg, "preprocess"),
                          scan_batch_size(cfg, source), {"cfg": cfg}, ("run_dir", "run_id", *decode_rt))]
    cpu = {"cfg": cfg}
    if r.fuse_cpu_stages:  # decode + preprocess in one actor: MediaTask -> Prepared
        out = [StageSpec("decode+preprocess", f"{_STAGES}.prepare:PrepareStage", _pool(cfg, "preprocess"),
                         r.preprocess.batch_size, cpu, decode_rt, produces="Prepared")]
    else:
        out = [StageSpec("decode", f"{_STAGES}.decode:DecodeStage", _pool(cfg, "decode"), r.decode.batch_size, cpu,
                         decode_rt, produces="Decoded"),
               StageSpec("preprocess", f"{_STAGES}.preprocess:PreprocessStage", _pool(cfg, "preprocess"),
                         r.preprocess.batch_size, cpu, ("meter",), reads="Decoded", produces="Prepared")]
    gpus = model_gpus(cfg, cluster)  # per rank; a replica of model.tensor_parallel_size ranks
    # batch_size=None: one call per block, so a task's rows are handed on when that call ends (block_bytes).
    # Ray Data refuses batch_size=None for an operator that requests GPUs ("You must provide `batch_size`"):
    # there the model batch size, which the blocks are already sized to, gives about one call per block too.
    # Concurrent calls on one model actor feed one continuous batch (pipeline/stages/model_stage.py).
    out.append(StageSpec("model", f"{_STAGES}.model_stage:ModelStage",
                         _pool(cfg, "model", gpus=gpus, ranks=cfg.model.tensor_parallel_size),
                         None if not gpus else r.model.batch_size, cpu, ("meter", "metrics"),
                         {"enable_true_multi_threading": True,
                          "max_concurrent_calls_per_actor": r.model.max_concurrent_batches},
                         reads="Prepared", produces="Generated"))
    out.append(StageSpec("write", f"{_STAGES}.write_stage:WriteStage", _pool(cfg, "write"), r.write.batch_size,
                         {"cfg": cfg}, ("run_dir", "run_id"), reads="Generated"))
    return out


def pools(cfg: JobConfig, cluster: Cluster | None) -> list[Pool]:
    """Every pool of the run at its minimum size, the manifest read's included (the fit checks' list)."""
    return [s.pool for s in stage_specs(cfg, cluster)] + [read_spec().pool]


def requests_per_media(cfg: JobConfig) -> int | None:
    """Requests every manifest row expands to, when the config alone decides it (else None)."""
    t = cfg.task
    if t.mode == "caption":
        return 1
    if cfg.input.columns.questions:
        return None
    return (len(t.questions) + int(t.caption)) or 1


@dataclass(frozen=True)
class RunPlace:
    """Where the run's files go, made once per start (`plan/preflight.py`) and read by every step after it:
    `run_id` (`JobConfig.resolved_run_id`), `run_uri` (`<output.uri>/<run_id>`), `storage` (the
    `StorageOptions` of the input, the checkpoint and the output), `fingerprint` (`plan/fingerprint.py`'s
    `FingerprintNote`: what the start writes; None: not checked, `plan` called without the preflight)."""

    run_id: str
    run_uri: str
    storage: StorageOptions
    fingerprint: object = None

    @classmethod
    def of(cls, cfg: JobConfig) -> RunPlace:
        return cls(cfg.resolved_run_id(), run_uri(cfg.output.uri, cfg.resolved_run_id()), cfg.storage.options())


def run_uri(output_uri: str, run_id: str) -> str:
    """`<output.uri>/<run_id>`: the run's folder."""
    return join(output_uri.rstrip("/"), run_id)


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, checked (`plan/preflight.py`): its config (default pools sized to the cluster),
    source, counts, the cluster (None: not known yet, GPUs as configured) and its stages."""

    cfg: JobConfig
    source: object  # the run's `Source` (pipeline/sources)
    media: int | None  # manifest rows / glob matches (input.limit applied); None: counted while read
    requests: int | None  # output rows when every media's request count is fixed by the config
    cluster: Cluster | None
    stages: list[StageSpec]  # the actor stages, graph order
    read: StageSpec  # the manifest read (tasks)
    run: RunPlace  # the run id, its folder and the storage options, made once
    block_bytes: int  # Ray Data's target block size (`block_bytes`)
    sized: dict = field(default_factory=dict)  # {stage: num_cpus} the preflight sized down to fit

    def pools(self) -> list[Pool]:
        return [s.pool for s in self.stages] + [self.read.pool]

    def reserves(self) -> tuple[float, float]:
        """(CPUs, GPUs) the pools reserve at their minimum sizes, the read included."""
        ps = self.pools()
        return sum(p.actor_cpus * p.min_actors for p in ps), sum(p.actor_gpus * p.min_actors for p in ps)

    def pools_text(self) -> str:
        """The plan line's pools, e.g. ``pools: decode+preprocess 1-2 x 1 CPU, model 1 x 1 CPU + 0 GPU, ...``."""
        parts = []
        for s in self.stages:
            p = s.pool
            size = f"{p.min_actors}" if p.min_actors == p.max_actors else f"{p.min_actors}-{p.max_actors}"
            per = f"{p.num_cpus:g} CPU" + (f" + {p.num_gpus:g} GPU" if s.name == "model" else "")
            parts.append(f"{s.name} {size} x " + (f"{p.ranks} ranks x {per}" if p.ranks > 1 else per))
        cpus, gpus = self.reserves()
        return f"pools: {', '.join(parts)}; reserves {cpus:.2f} CPUs, {gpus:g} GPUs"

    def device_line(self) -> str | None:
        """The one line saying the model will run on the CPU though `model.device` is `auto`: it asked no GPU
        (`resources.model.num_gpus: 0`), or asked GPUs and there are none (None: a GPU, `device: cpu`, scan)."""
        c, cfg = self.cluster, self.cfg
        if cfg.task.mode == "scan" or cfg.model.device != "auto":
            return None
        if cfg.resources.model.num_gpus == 0:
            return ("the model will run on the CPU: resources.model.num_gpus=0 (set it to 1 to give each model "
                    "actor a GPU, or model.device=cpu to say the CPU is meant)")
        if not cpu_fallback(cfg, c):
            return None
        return (f"the model will run on the CPU: no GPU {'here' if c.fixed_size else 'on ' + c.where} "
                f"(resources.model.num_gpus={self.cfg.resources.model.num_gpus:g}, model.device=auto; set "
                "resources.model.num_gpus=0 to plan it there, or model.device=cuda to require a GPU)")

    def line(self) -> str:
        """The plan line `vlbatch run` prints before Ray starts."""
        what = "input counted as it is read" if self.media is None else f"{self.media} media"
        if self.media is not None and self.requests is not None and self.requests != self.media:
            what += f" -> {self.requests} requests"
        return f"[vlbatch] plan: {what} from {self.cfg.input.uri}; {self.pools_text()}"

    def pools_line(self) -> str:
        """What `vlbatch validate` prints: each pool per actor, what they reserve and what the cluster has, e.g.
        ``preprocess 1x0.86 CPU, model 1x0.86 CPU, write 1x0.21 CPU, input (manifest read) 1x0.05 CPU;
        reserves 1.98 CPUs, 0 GPUs of 2 CPUs, 0 GPUs, 5.1 GiB on this machine``."""
        parts = []
        for p in self.pools():
            what = f"{p.actor_cpus:g} CPU" + (f" {p.actor_gpus:g} GPU" if p.actor_gpus else "") + \
                (f" {p.actor_memory / GIB:g} GiB" if p.actor_memory else "")
            parts.append(f"{p.field.removeprefix('resources.')} {p.min_actors}x{what}")
        cpus, gpus = self.reserves()
        c = self.cluster
        where = "" if c is None else \
            f" of {c.cpus:g} CPUs, {c.gpus:g} GPUs, {c.memory_bytes / GIB:.1f} GiB on {c.where}"
        return f"{', '.join(parts)}; reserves {cpus:.2f} CPUs, {gpus:g} GPUs{where}"


def plan(cfg: JobConfig, cluster: Cluster | None, *, source=None, media: int | None = None,
         sized: dict | None = None, run: RunPlace | None = None) -> RunPlan:
    """The run's plan on `cluster`. `source` (and its `media` count): the run's `Source` when the
    preflight opened it already; None: opened and counted here. `run`: the preflight's (None: made here)."""
    run = RunPlace.of(cfg) if run is None else run
    if source is None:
        from vlbatch.pipeline.sources import open_source

        source = open_source(cfg, run.storage)
        media = source.count()
    k = requests_per_media(cfg)
    return RunPlan(cfg, source, media, None if media is None or k is None else media * k, cluster,
                   stage_specs(cfg, cluster, source), read_spec(), run, block_bytes(cfg), dict(sized or {}))


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
    back, a quarter of Ray Data's per-batch work. A call's frames are one media's at a time.
    `source` None (a plan for the fit checks only): as for URI manifests."""
    pre = cfg.resources.preprocess
    if "batch_size" in pre.model_fields_set or (source is not None and source.embeds_media()):
        return pre.batch_size
    return SCAN_BATCH_SIZE
