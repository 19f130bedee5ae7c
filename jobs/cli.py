"""The `vlbatch` command line: one subcommand per user action.

Exit codes (also in README "Troubleshooting"; constants in jobs/errors.py):
  0  success (for submit/logs without --wait/--follow: the request was accepted)
  1  the job ran but failed (or its errors passed both max_error_fraction and min_error_rows)
  2  bad usage or an invalid config (nothing was started)
  3  duplicate: this submission id (job name + slot) was already submitted; not started again
  4  no job with this submission id on the cluster
  5  the Ray cluster (run: its GCS address; other commands: its Jobs API) could not be reached
     or refused the connection (e.g. token authentication)
  6  another run of the same job is still running (overlap guard); not started
  7  the job was stopped before it finished
  8  run: an actor could not start (model or processor load, a checkpoint download); one line
     names the cause, the detail is in ~/.local/state/vlbatch/runs/<run_id>/error.log
  130 / 143  run: interrupted by SIGINT (Ctrl-C) / SIGTERM; what was committed stays, rerun to resume
  141  stdout was closed early (e.g. `vlbatch validate --json | head`)
"""
from __future__ import annotations

import argparse
import os
import sys

from vlbatch.jobs.errors import EXIT_BROKEN_PIPE, EXIT_SIGINT


def _cmd_demo(args: argparse.Namespace) -> int:
    from vlbatch.jobs.demo import run_demo, run_preprocess_demo

    # the demo's tiny model: numba's own SIMD width, not the first-run probe (~35 s; operators/host_simd.py)
    os.environ.setdefault("VLBATCH_SIMD", "off")  # this command owns its process and its local Ray
    if args.preprocess_only:
        return run_preprocess_demo(out_dir=args.out)
    return run_demo(out_dir=args.out)


def _cmd_tiny(args: argparse.Namespace) -> int:
    from vlbatch.devtools.checkpoints.tiny import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.out_dir, args.variant, seed=args.seed, shards=args.shards))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from vlbatch.jobs.inspect.text import run_inspect

    return run_inspect(args.run, sample=args.sample, where=args.where, seed=args.seed, html=args.html,
                       endpoint_url=args.endpoint_url)


def _cmd_export(args: argparse.Namespace) -> int:
    from vlbatch.jobs.export.command import run_export

    return run_export(args.run, layout=args.layout, fmt=args.format, dest=args.out, config=args.config,
                      endpoint_url=args.endpoint_url, bucket_rows=args.bucket_rows, tmp_dir=args.tmp_dir)


def _add_export(sub) -> None:
    exp = sub.add_parser(
        "export", help="a run's rows as one Parquet, JSONL or CSV file: per request, or one row per media with "
                       "each prompt a typed column", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a run's output as one file (local or s3://), streamed: memory stays bounded at any\n"
                    "run size. --layout rows: one line per request, the run's columns. --layout media: one row per\n"
                    "media (per clip), the caption and each named prompt its own column typed from its\n"
                    "response format (JSON schema objects: structs; arrays: lists; enums and choices: dictionary\n"
                    "strings), <name>_status, and the kept input columns. JSONL nests structured values; CSV\n"
                    "cells hold them as JSON text. Prints `exported N rows (M media, C clips) to DEST`.")
    exp.add_argument("run", help="run directory (<output.uri>/<run_id>, local or s3://) or a job config")
    exp.add_argument("--layout", choices=["media", "rows"], default="media", help="media (default) or rows")
    exp.add_argument("--format", choices=["parquet", "jsonl", "csv"], default="parquet",
                     help="file format (default parquet)")
    exp.add_argument("-o", "--out", required=True, metavar="DEST",
                     help="the file to write (local path or s3://bucket/key); replaced whole, never half written")
    exp.add_argument("--config", metavar="JOB.yaml",
                     help="the run's job config, for the prompts' formats (media layout) when the run folder has "
                          "no _fingerprint.json")
    exp.add_argument("--endpoint-url", help="S3-compatible endpoint for an s3:// run directory or DEST")
    exp.add_argument("--bucket-rows", type=int, default=200_000,
                     help="media layout: rows grouped in memory at a time (default 200000; the run is hashed into "
                          "run rows / this many temporary buckets)")
    exp.add_argument("--tmp-dir", help="media layout: where the temporary buckets go (default: the system's temp "
                                       "folder; needs about the run's size in free space)")
    exp.set_defaults(func=_cmd_export)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vlbatch", description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Exit codes"):], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the demo job end to end (local Ray, sample media, local Parquet)")
    demo.add_argument("--out", default="out/demo", help="output folder (default: out/demo)")
    demo.add_argument("--preprocess-only", action="store_true",
                      help="only run preprocessing over generated samples and print what it produced")
    demo.set_defaults(func=_cmd_demo)

    ins = sub.add_parser("inspect", help="what a run produced: counts, errors, tokens, throughput attempt by attempt, "
                                         "sample rows")
    ins.add_argument("run", help="run directory (<output.uri>/<run_id>, local or s3://) or a job config")
    ins.add_argument("--sample", type=int, default=8, help="rows to show (default 8)")
    ins.add_argument("--where", action="append", metavar="COLUMN=VALUE",
                     help="sample only matching rows, e.g. status=error (repeatable: all must match)")
    ins.add_argument("--seed", type=int, default=0, help="which random sample (default 0)")
    ins.add_argument("--html", metavar="PATH", help="also write a self-contained HTML page with thumbnails")
    ins.add_argument("--endpoint-url", help="S3-compatible endpoint for an s3:// run directory")
    ins.set_defaults(func=_cmd_inspect)

    _add_export(sub)

    tiny = sub.add_parser("make-tiny-checkpoint", help="write a tiny random Qwen3.5 checkpoint (HF layout)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--variant", choices=["dense", "dense_tied", "moe"], default="dense")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shards", type=int, default=1)
    tiny.set_defaults(func=_cmd_tiny)

    from vlbatch.jobs.commands import add_job_commands

    add_job_commands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:  # `vlbatch validate --json | head`: the reader left; say nothing more
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C outside a run (which handles its own: jobs/stops.py)
        print("vlbatch: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except BaseException as e:  # a run's stop before its config was read (no run directory to name yet)
        from vlbatch.jobs.stops import Interrupted

        if not isinstance(e, Interrupted):
            raise
        print("vlbatch: interrupted", file=sys.stderr)
        return e.exit_code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not raise again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
