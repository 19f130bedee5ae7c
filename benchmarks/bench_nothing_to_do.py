"""The rerun check of `vlbatch run` (`pipeline/startup/nothing_to_do.py`) at scale, one process, no Ray.

    python -m benchmarks.bench_nothing_to_do [--requests 1000000] [--questions 4]

Writes a local Parquet manifest of `--requests / --questions` media URIs (`task.questions`: `--questions` of
them each) and a run folder whose one part file commits every one of its request ids, then times:
- `all committed`: `nothing_to_do(plan)` as a rerun calls it (the committed index read, the manifest read and
  every row expanded to its ids, looked up): what a finished job's rerun now costs instead of starting Ray
  (20-25 s on a 2-core machine) and expanding the same rows in Ray tasks;
- `last missing`: the same with the manifest's last request not committed: the worst case of a run that
  does have work (the walk stops at the first block holding a pending id, here the last one).
Prints the seconds of each and the per-request cost; then, as the reference in the same run, the seconds
of starting and stopping a new local Ray (`ray.init()` + `ray.shutdown()`, less than a run's own start: no
actor pools), which a rerun with nothing left no longer spends (`--no-ray`: not measured).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def _plan(work: Path, n_media: int, n_questions: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.plan.spec import plan

    man = work / "manifest.parquet"
    pq.write_table(pa.table({"media_uri": [f"{work}/media/m{i:08d}.png" for i in range(n_media)]}), man,
                   row_group_size=50_000)
    cfg = validate_config({"model": {"path": str(work / "model")}, "input": {"uri": str(man), "format": "parquet"},
                           "task": {"mode": "questions", "questions": [f"Question {q}?" for q in range(n_questions)]},
                           "output": {"uri": str(work / "out"), "run_id": "bench"}})
    return plan(cfg, None)


def _commit_all(p, drop_last: bool) -> int:
    """Commit every request id of `p`'s input (but the last one with `drop_last`) as ok rows; -> ids committed."""
    import pyarrow as pa

    from vlbatch.operators.sink.schema import OUTPUT_SCHEMA
    from vlbatch.pipeline.plan.sink import open_sink
    from vlbatch.pipeline.startup.nothing_to_do import block_ids

    ids = [rid for b in p.source.driver_blocks() for rid in block_ids(b, p.cfg.task)]
    ids = ids[:-1] if drop_last else ids
    n = len(ids)
    fixed = {"id": ids, "status": ["ok"] * n, "request_index": [0] * n, "media_type": ["image"] * n,
             "prompt": ["q"] * n, "model": ["m"] * n, "run_id": ["bench"] * n}
    table = pa.table({f.name: pa.array(fixed[f.name], f.type) if f.name in fixed else pa.nulls(n, f.type)
                      for f in OUTPUT_SCHEMA}, schema=OUTPUT_SCHEMA)
    sink = open_sink(p.cfg, f"{p.cfg.output.uri}/bench")
    sink.prepare()
    for part in sink.parts():
        sink.fs.rm_file(part)
    sink.commit(table)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--no-ray", action="store_true", help="skip the reference (starting a local Ray)")
    args = ap.parse_args()
    from vlbatch.pipeline.startup.nothing_to_do import nothing_to_do

    with tempfile.TemporaryDirectory(prefix="vlb-ntd-") as tmp:
        p = _plan(Path(tmp), max(1, args.requests // args.questions), args.questions)
        for name, drop_last in (("all committed", False), ("last missing", True)):
            n = _commit_all(p, drop_last)
            t0 = time.perf_counter()
            found = nothing_to_do(p)
            s = time.perf_counter() - t0
            what = f"nothing to do ({found.requests} requests)" if found else "work left: Ray would start"
            print(f"{name:<14} {n:>9} ids committed: {s:6.2f} s ({s / max(n, 1) * 1e6:.2f} us/request) -> {what}",
                  flush=True)
    if not args.no_ray:
        print(f"{'reference':<14} a new local Ray started and stopped: {_ray_start_s():6.2f} s", flush=True)


def _ray_start_s() -> float:
    import ray

    t0 = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False)
    ray.shutdown()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
