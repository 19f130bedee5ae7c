"""Manifest reading: our line reader (pipeline/sources/text.py) against Arrow's JSON reader, one process.

    python benchmarks/bench_manifest.py [--lines 200000] [--repeat 3]

Writes a JSONL manifest of `--lines` rows (a relative media path and two questions each) and
reads it into manifest blocks (`base.MANIFEST_SCHEMA`, paths resolved) two ways, side by side,
each `--repeat` times (the median printed):
- reference: `pyarrow.json.read_json` of the whole file + `cells.normalise` (what Ray Data's
  `read_json` did per file on 6a0b046, without Ray's task overhead, and without per-line errors);
- ours: `text.read_text_files` (line by line, per-line typed errors, blocks of 4096 rows).
Prints rows/s of each and the ratio. Both run in this process on one core; what matters is the
rate against the model's (a few requests/s per CPU actor).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa


def _cfg(uri: str):
    from vlbatch.pipeline.config import validate_config

    return validate_config({"model": {"path": "m"}, "output": {"uri": "/tmp/out"},
                            "input": {"uri": uri, "format": "jsonl", "columns": {"questions": "questions"}},
                            "task": {"mode": "questions", "questions": ["q"]}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import pyarrow.json as pj

    from vlbatch.pipeline.sources.cells import normalise
    from vlbatch.pipeline.sources.text import read_text_files

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.jsonl"
        path.write_text("".join(json.dumps({"media_uri": f"imgs/{i:08d}.jpg", "questions": ["What?", "Why?"]}) + "\n"
                                for i in range(args.lines)))
        cfg = _cfg(str(path))
        batch = pa.table({"path": [str(path)]})

        def ref() -> int:
            return normalise(pj.read_json(str(path)), cfg, d).num_rows

        def ours() -> int:
            return sum(b.num_rows for b in read_text_files(batch, cfg=cfg, base_uri=d))

        times = {"arrow read_json + normalise": [], "text.read_text_files": []}
        for _ in range(args.repeat):
            for name, fn in zip(times, (ref, ours), strict=True):
                t0 = time.perf_counter()
                assert fn() == args.lines
                times[name].append(time.perf_counter() - t0)
    rates = {k: args.lines / statistics.median(v) for k, v in times.items()}
    for k, r in rates.items():
        print(f"{k:30s} {r:12,.0f} rows/s (median of {args.repeat})")
    a, b = rates.values()
    print(f"ours / reference: {b / a:.2f}")


if __name__ == "__main__":
    main()
