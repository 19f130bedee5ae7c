"""What Ray metrics cost a run (issue 53: metrics on vs off within 2 %), in CPU time, not wall time.

    python -m benchmarks.bench_metrics_cost [--exports 4000] [--calls 4000] [--rows-per-s 11] [--batch-rows 32]

Wall-clock rows/s with metrics on vs off (`bench_pipeline`'s last lines) differ by more than 2 % from one
run to the next on a shared 2-core machine, whatever the metrics do. This bench measures the metrics' own
work instead, on a new local Ray (the real `ray.util.metrics` objects, recording to this node's agent):
- `MeterMetrics.export` (the `Meter` actor, per `Meter.add`): each `MeterClient` sends at most once per
  second (`every_s`), so a run does at most one export per stage actor per second, plus the driver's
  committed-stats blocks;
- `ModelMetrics.call` + `busy_fraction` (a model actor, per model-stage call).
Prints the CPU microseconds of each (process CPU time over `--exports` / `--calls` repetitions with
growing counts, as a run sends them), then the share of one core they take at a run's rates: `--actors`
exports per second (the demo's pools: 1 CPU stage + 1 model + 1 write + the driver = 4), and model calls
at `--rows-per-s` / `--batch-rows` per second (bench_pipeline's measured rows/s, one call's rows). The
target: under 2 % of the run's CPU; a pipeline uses at least one core, so the share of one core bounds it.
"""
from __future__ import annotations

import argparse
import time


def _cpu_us_per(fn, n: int) -> float:
    t0 = time.process_time()
    for i in range(n):
        fn(i)
    return (time.process_time() - t0) / n * 1e6


def _counts(i: int) -> dict:
    """A cumulative count dict as the Meter holds it mid-run (every key grows)."""
    return {"decoded": 32 * i, "preprocessed": 32 * i, "model_in": 32 * i, "generated": 30 * i, "committed": 28 * i,
            "prompt_tokens": 900 * i, "visual_tokens": 600 * i, "generated_tokens": 400 * i, "cached_tokens": 300 * i,
            "vision_hits": i, "vision_encodes": 2 * i, "error:MediaError": i // 50, "quality:repetition": i // 20}


def measure(exports: int, calls: int) -> tuple[float, float]:
    """-> (CPU us per `MeterMetrics.export`, CPU us per model call's metrics), on a local Ray started here."""
    import ray

    from vlbatch.pipeline.telemetry.metrics import MeterMetrics, MetricTags, ModelMetrics

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        tags = MetricTags(job="bench", run_id="bench-metrics")
        meter, model = MeterMetrics(tags), ModelMetrics(tags)
        _cpu_us_per(lambda i: meter.export(_counts(i + 1)), 50)  # warm: the first calls register the series
        export_us = _cpu_us_per(lambda i: meter.export(_counts(i + 51)), exports)

        def call(i: int) -> None:
            model.call(0.05 + (i % 17) * 0.1)
            model.busy_fraction((i % 100) / 100)

        call_us = _cpu_us_per(call, calls)
        return export_us, call_us
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exports", type=int, default=4000)
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--actors", type=int, default=4, help="stage actors + driver sending to the meter (each <= 1/s)")
    ap.add_argument("--rows-per-s", type=float, default=11.0, help="the run's rows/s (bench_pipeline's figure)")
    ap.add_argument("--batch-rows", type=float, default=32.0, help="rows per model-stage call")
    args = ap.parse_args(argv)
    export_us, call_us = measure(args.exports, args.calls)
    per_s = args.actors * export_us + args.rows_per_s / args.batch_rows * call_us
    print(f"MeterMetrics.export: {export_us:.1f} CPU us each ({args.exports} exports, 13 keys, growing counts)")
    print(f"ModelMetrics per model call (histogram + gauge): {call_us:.1f} CPU us each ({args.calls} calls)")
    print(f"at {args.actors} exports/s and {args.rows_per_s:g} rows/s in calls of {args.batch_rows:g} rows: "
          f"{per_s:.0f} CPU us per second = {per_s / 1e4:.3f} % of one core (target: <= 2 % of the run's CPU)")
    worst = 1e6 / max(export_us, 1e-9)
    print(f"exports/s that would take 2 % of one core: {0.02 * worst:.0f} (a run sends <= 1 per actor per second)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
