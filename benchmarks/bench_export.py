"""`vlbatch export --layout media` at scale: its peak memory must not grow with the run (`jobs/export/media.py`).

    python -m benchmarks.bench_export [--rows 100000 1000000 2000000] [--bucket-rows 100000] [--format parquet]

For each size, writes a run folder of that many rows (4 prompts per media: a caption, a free question, a
JSON-schema prompt whose value is an object of an integer, a boolean, a list of strings and an enum, and
a choice; parts of 100,000 rows, every media's last prompt committed in the next part, as a resumed run
does) with its `_fingerprint.json`, then exports it in a child process (`python -m vlbatch.jobs.cli
export`) and prints the child's seconds, rows/s and peak RSS (ru_maxrss). Flat: memory is bounded by
`--bucket-rows` (one bucket held at a time, plus one part), not by the run: the 10^6 and 2 x 10^6 exports
peak alike; the 10^5 one (a single bucket, grouped straight from its parts, no pass 1) a little lower.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PART_ROWS = 100_000
PROMPTS = 4
SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}, "text": {"type": "boolean"},
                                           "labels": {"type": "array", "items": {"type": "string"}},
                                           "shape": {"enum": ["circle", "square", "triangle"]}}}


def _config(out: Path):
    from vlbatch.pipeline.config import validate_config

    return validate_config({
        "model": {"path": "m"}, "input": {"uri": "in.jsonl"}, "output": {"uri": str(out), "run_id": "bench"},
        "task": {"mode": "questions", "caption": True, "questions": [
            "How many people?", {"name": "tags", "prompt": "Tag it.",
                                 "response_format": {"type": "json_schema", "schema": SCHEMA}},
            {"name": "has_text", "prompt": "Text?", "response_format": {"type": "choice", "choices": ["yes", "no"]}}]}})


def _part(lo: int, hi: int):
    """Rows [lo, hi) of the run: row r is prompt r % 4 of media r // 4 (shifted by one, module docstring)."""
    import numpy as np
    import pyarrow as pa

    from vlbatch.operators.sink.schema import OUTPUT_SCHEMA

    r = np.arange(lo, hi) + 1  # media m's prompt 3 lands one row later: in the next part at a boundary
    media, prompt = r // PROMPTS, r % PROMPTS
    names = np.array(["q0", "tags", "has_text", "caption"])[prompt]
    tags = [json.dumps({"count": int(m % 7), "text": bool(m % 2), "labels": ["red", f"l{m % 13}"],
                        "shape": ["circle", "square", "triangle"][m % 3]}) for m in media.tolist()]
    parsed = np.where(prompt == 1, np.array(tags, object), np.where(prompt == 2, '"yes"', None))
    answer = np.where(prompt == 3, "A red square on a white background, and a blue circle beside it.", "Two.")
    n = hi - lo
    cols = {"id": pa.array([f"{i:032x}" for i in range(lo, hi)]), "request_index": pa.array(prompt, pa.int32()),
            "media_uri": pa.array([f"s3://bucket/media/{m:09d}.jpg" for m in media.tolist()]),
            "media_type": pa.array(["image"] * n), "prompt": pa.array(["p"] * n), "prompt_name": pa.array(names),
            "answer": pa.array(answer), "parsed": pa.array(parsed.tolist(), pa.string()),
            "status": pa.array(["ok"] * n), "model": pa.array(["m"] * n), "run_id": pa.array(["bench"] * n)}
    t = pa.table({f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in OUTPUT_SCHEMA})
    return t.cast(OUTPUT_SCHEMA)


def make_run(out: Path, rows: int) -> str:
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.pipeline.plan.fingerprint import record_fingerprint

    sink = ParquetSink(str(out / "bench"))
    sink.prepare()
    for lo in range(0, rows, PART_ROWS):
        sink.commit(_part(lo, min(rows, lo + PART_ROWS)))
    record_fingerprint(_config(out))
    return str(out / "bench")


def export_child(run: str, dest: Path, fmt: str, bucket_rows: int) -> tuple[float, float, str]:
    """(seconds, peak RSS MiB of the child, its summary line)."""
    code = ("import resource, sys; from vlbatch.jobs.cli import main; rc = main(sys.argv[1:]); "
            "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, "export", run, "--layout", "media", "--format", fmt,
                          "--bucket-rows", str(bucket_rows), "-o", str(dest)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"export failed ({res.returncode}): {res.stderr[-2000:]}")
    lines = res.stdout.splitlines()
    rss = int(next(x for x in lines if x.startswith("maxrss_kb")).split()[1]) / 1024
    return seconds, rss, next(x for x in lines if x.startswith("exported"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 2_000_000])
    ap.add_argument("--bucket-rows", type=int, default=100_000)
    ap.add_argument("--format", default="parquet", choices=["parquet", "jsonl", "csv"])
    args = ap.parse_args()
    print(f"bench_export: media layout, {PROMPTS} prompts per media, parts of {PART_ROWS} rows, "
          f"--bucket-rows {args.bucket_rows}, {args.format}")
    for rows in args.rows:
        with tempfile.TemporaryDirectory(prefix="bench-export-") as work:
            t0 = time.perf_counter()
            run = make_run(Path(work) / "out", rows)
            made = time.perf_counter() - t0
            seconds, rss, line = export_child(run, Path(work) / f"media.{args.format}", args.format, args.bucket_rows)
            print(f"  {rows:>10,} rows: run written in {made:.1f} s; export {seconds:.1f} s "
                  f"({rows / seconds:,.0f} rows/s), peak RSS {rss:,.0f} MiB  [{line.split(' to ')[0]}]", flush=True)
    print(f"  (this process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB)")


if __name__ == "__main__":
    main()
