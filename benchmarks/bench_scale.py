"""The pipeline's own machinery at scale, in scan mode (no model).

    python benchmarks/bench_scale.py [--requests 1000000] [--rss-at 100000] [--images 3000] [--cpus 2]

Builds N requests: N/4 distinct media URIs (hard links to `--images` small distinct PNGs),
4 questions each, one Parquet manifest; runs them with `task.mode: scan` on a local Ray, and
prints side by side:
- requests/s of the pipeline vs the same decode + preprocess in a plain loop (a process pool
  of `--cpus` processes over the same files), target >= 0.8. The loop runs right before and
  right after the N run and the ratio is taken against the mean of the two: this machine's
  own speed drifts ~10 % over minutes (the loop alone measured 8238 to 9651 req/s on one
  day), so one loop run at another time compares the pipeline with another machine;
- driver peak RSS (each N in its own process) at `--rss-at` and at N, target ratio <= 1.5;
- number and mean size of the part files at the default roll settings (target <= 100 at 1M);
- resume start-up with everything committed (the whole rerun) and with half committed (up to
  the graph start), target <= 5% of the run's wall time;
- the per-request costs that extrapolate each figure to 100M requests.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is shown?", "What colour is it?", "Is there text?", "Describe the scene."]


def make_inputs(work: Path, n_req: int, n_images: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    n_media = max(1, n_req // len(QUESTIONS))
    src, media = work / "src", work / "media"
    src.mkdir(parents=True, exist_ok=True)
    media.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(min(n_images, n_media)):
        Image.fromarray(rng.integers(0, 255, (32 + i % 17, 40 + i % 23, 3), np.uint8)).save(src / f"{i}.png")
    uris = []
    for j in range(n_media):
        p = media / f"m{j:08d}.png"
        if not p.exists():
            os.link(src / f"{j % min(n_images, n_media)}.png", p)
        uris.append(str(p))
    man = work / "manifest.parquet"
    pq.write_table(pa.table({"media_uri": uris}), man, row_group_size=50_000)
    return man


def manifest_for(work: Path, n_req: int) -> Path:
    """The first n_req / 4 media of the full manifest, as its own file."""
    import pyarrow.parquet as pq

    man = work / f"manifest-{n_req}.parquet"
    if not man.exists():
        pq.write_table(pq.read_table(work / "manifest.parquet").slice(0, max(1, n_req // len(QUESTIONS))), man,
                       row_group_size=50_000)
    return man


def job(model: str, man: Path, out: Path, cpus: int) -> dict:
    return {"model": {"path": model}, "input": {"uri": str(man), "format": "parquet"},
            "task": {"mode": "scan", "questions": QUESTIONS}, "image": {"max_pixels": 65536},
            # preprocess batch_size: the scan default
            "resources": {"preprocess": {"num_cpus": round((cpus - 0.2) / cpus, 3), "min_actors": cpus,
                                         "max_actors": cpus},
                          "write": {"num_cpus": 0.1, "min_actors": 1, "max_actors": 2, "batch_size": 1024}},
            "output": {"uri": str(out), "run_id": "scan"}, "max_error_fraction": 1.0}


def _loop_init(cfg_json: str):
    global _STAGE
    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.stages.prepare import PrepareStage

    _STAGE = PrepareStage(JobConfig.model_validate_json(cfg_json))


def _loop_one(uri: str) -> int:
    from vlbatch.pipeline.stages.requests import expand

    t = expand(uri, None, None, _STAGE.decode.cfg.task)
    return len(_STAGE.preprocess.prepare_one(_STAGE.decode.decode_one(t)).input_ids)


def plain_loop(cfg, uris: list[str], cpus: int) -> float:
    """Requests/s of decode + preprocess in a process pool (start-up not timed)."""
    with ProcessPoolExecutor(cpus, initializer=_loop_init, initargs=(cfg.model_dump_json(),)) as ex:
        list(ex.map(_loop_one, uris[:cpus], chunksize=1))  # warm
        t0 = time.perf_counter()
        n = sum(ex.map(_loop_one, uris, chunksize=256))
        return n / (time.perf_counter() - t0)


def one(args) -> dict:
    """One N in this process: the run, its parts, both resumes; driver peak RSS."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from vlbatch.pipeline.config import JobConfig
    from vlbatch.pipeline.graph import _init_ray, _open_run, run_job
    from vlbatch.pipeline.sources import open_source
    from vlbatch.pipeline.stages.expansion import count_pending, expanded

    work = Path(args.work)
    model, man = str(work / "model"), manifest_for(work, args.one)
    out = work / f"out-{args.one}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = JobConfig.model_validate(job(model, man, out, args.cpus))
    ray.init(num_cpus=args.cpus, log_to_driver=False, include_dashboard=False)
    _init_ray(cfg)
    t0 = time.perf_counter()
    s = run_job(cfg, stream=open(os.devnull, "w"))
    wall = time.perf_counter() - t0
    rss_run = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    parts = sorted((out / "scan").glob("part-*.parquet"))
    sizes = [p.stat().st_size for p in parts]
    t1 = time.perf_counter()
    again = run_job(cfg, stream=open(os.devnull, "w"))
    resume_full = time.perf_counter() - t1
    half = work / f"half-{args.one}"
    shutil.rmtree(half, ignore_errors=True)
    shutil.copytree(out, half)
    parts_half = sorted((half / "scan").glob("part-*.parquet"))
    every = pa.concat_tables([pq.read_table(p) for p in parts_half])
    for p in parts_half:
        p.unlink()
    rows = every.num_rows // 2  # the first half of the rows, committed as one part
    pq.write_table(every.slice(0, rows), half / "scan" / "part-half.parquet", compression="zstd")
    hcfg = JobConfig.model_validate({**job(model, man, half, args.cpus)})
    t2 = time.perf_counter()
    _, _, _, done = _open_run(hcfg, str(half / "scan"))
    pending, _ = count_pending(expanded(open_source(hcfg), ray.put(done)).materialize())
    resume_half = time.perf_counter() - t2
    return {"requests": s.requests_computed, "wall_s": wall, "rps": s.requests_computed / wall,
            "errors": s.processed_by_status.get("error", 0), "rss_mb": rss_run, "parts": len(parts),
            "mean_part_mb": (sum(sizes) / len(sizes) / 2**20) if sizes else 0.0, "resume_full_s": resume_full,
            "resume_full_pending": again.requests_computed, "resume_half_s": resume_half,
            "resume_half_committed": rows, "resume_half_pending": pending}


def run_one(n: int, args) -> dict:
    cmd = [sys.executable, __file__, "--one", str(n), "--work", args.work, "--images", str(args.images),
           "--cpus", str(args.cpus)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"run at N={n} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def report(small: dict, big: dict, loops: tuple[float, float]) -> None:
    n = big["requests"]
    print(f"{'':34s}{'N=' + str(small['requests']):>14s}{'N=' + str(n):>14s}")
    for k, fmt in (("wall_s", ".1f"), ("rps", ".0f"), ("rss_mb", ".0f"), ("parts", "d"), ("mean_part_mb", ".2f"),
                   ("resume_full_s", ".2f"), ("resume_half_s", ".2f"), ("errors", "d")):
        print(f"{k:34s}{small[k]:>14{fmt}}{big[k]:>14{fmt}}")
    loop_rps = sum(loops) / 2
    print(f"plain loop (same decode+preprocess) {loop_rps:12.0f} req/s (before / after the N run: {loops[0]:.0f} / "
          f"{loops[1]:.0f}); pipeline / loop = {big['rps'] / loop_rps:.2f} (target >= 0.8; "
          f"{big['rps'] / max(loops):.2f} against the faster loop run)")
    print(f"driver peak RSS ratio big/small = {big['rss_mb'] / small['rss_mb']:.2f} (target <= 1.5)")
    print(f"resume (all committed) / run wall = {big['resume_full_s'] / big['wall_s']:.1%} (target <= 5%)")
    dn = max(1, n - small["requests"])  # marginal costs: the fixed start-up (Ray, actors) cancels out
    per = {"s_per_req": max(0.0, big["wall_s"] - small["wall_s"]) / dn,
           "rss_b_per_req": max(0.0, big["rss_mb"] - small["rss_mb"]) * 2**20 / dn,
           "part_bytes_per_req": big["mean_part_mb"] * 2**20 * big["parts"] / n,
           "resume_s_per_req": max(0.0, big["resume_full_s"] - small["resume_full_s"]) / dn}
    print("marginal per request: " + json.dumps({k: f"{v:.3g}" for k, v in per.items()}))
    e = 100_000_000
    print(f"extrapolated to 100M: run {per['s_per_req'] * e / 3600:.0f} h on these cores; driver RSS "
          f"+{per['rss_b_per_req'] * e / 2**30:.2f} GiB; output {per['part_bytes_per_req'] * e / 2**30:.1f} GiB; "
          f"resume (all committed) {per['resume_s_per_req'] * e / 60:.0f} min")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--rss-at", type=int, default=100_000)
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--work", default=None)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.work = args.work or tempfile.mkdtemp(prefix="vlbatch-scale-")
    if args.one is not None:
        print(json.dumps(one(args)))
        return
    from vlbatch.devtools.checkpoints import make_tiny_checkpoint

    work = Path(args.work)
    if not (work / "model").exists():
        make_tiny_checkpoint(work / "model", "dense")
    make_inputs(work, args.requests, args.images)
    from vlbatch.pipeline.config import JobConfig

    uris = sorted(str(p) for p in (work / "media").glob("m*.png"))[: max(1, args.requests // len(QUESTIONS))]
    cfg = JobConfig.model_validate(job(str(work / "model"), work / "manifest.parquet", work / "x", args.cpus))
    small = run_one(min(args.rss_at, args.requests), args)
    before = plain_loop(cfg, uris, args.cpus)
    big = run_one(args.requests, args) if args.requests > args.rss_at else small
    report(small, big, (before, plain_loop(cfg, uris, args.cpus)))


if __name__ == "__main__":
    main()
