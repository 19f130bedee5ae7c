"""A rerun with nothing left to do starts no Ray (issue 50).

One real run of a tiny job through the CLI (joining the session's Ray, tests/conftest.py; a tiny checkpoint,
three images), then the same command with no RAY_ADDRESS (a run that started Ray would start a new local one)
and `RAY_TMPDIR` pointed at an empty folder: exit 0, the `nothing to do` line, `_summary.json` as it was and no
Ray session folder under that RAY_TMPDIR. A third run after one part file is deleted starts Ray (a new local
one: its session folder under that RAY_TMPDIR shows the check sees a start) and recomputes exactly the rows of
that part. The unit tests below check the decision itself
(`pipeline/startup/nothing_to_do.py`) on a real Parquet sink: a transient error row means work left.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
from test_jobs_support import read_output, vlbatch, write_job

from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA


def _session_dirs(root: Path) -> list[Path]:
    return [p for p in root.rglob("session_*")]


@pytest.mark.ray
def test_rerun_with_nothing_left_starts_no_ray_and_a_lost_part_is_recomputed(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=3, write_batch=1)
    pin = ["--set", "output.run_id=again", "--set", "output.part_rows=1"]  # one part per row
    run_dir = tmp_path / "output" / "again"
    first = vlbatch("run", str(cfg), "--no-lock", *pin, timeout=400)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    rows = read_output(run_dir)
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows), rows
    summary = (run_dir / "_summary.json").read_text()

    ray_tmp = Path(tempfile.mkdtemp(prefix="vlbn-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    second = vlbatch("run", str(cfg), "--no-lock", *pin, env={"RAY_TMPDIR": str(ray_tmp)}, timeout=400,
                     local_ray=True)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    lines = second.stdout.splitlines()
    assert lines[-1] == f"[vlbatch] nothing to do: all 3 requests of {run_dir}/ are committed", lines
    assert "[vlbatch] starting Ray" not in second.stdout, second.stdout
    assert _session_dirs(ray_tmp) == [] and list(ray_tmp.iterdir()) == [], list(ray_tmp.rglob("*"))
    assert (run_dir / "_summary.json").read_text() == summary  # kept as it is
    assert read_output(run_dir) == rows

    parts = sorted(run_dir.glob("part-*.parquet"))
    lost = pa.parquet.read_table(parts[0]).column("id").to_pylist() if len(parts) > 1 else None
    assert lost is not None and len(lost) == 1, parts  # output.part_rows=1: one row per part
    parts[0].unlink()
    third = vlbatch("run", str(cfg), "--no-lock", *pin, env={"RAY_TMPDIR": str(ray_tmp)}, timeout=400,
                    local_ray=True)
    assert third.returncode == 0, (third.stdout + third.stderr)[-4000:]
    assert "[vlbatch] starting Ray" in third.stdout and _session_dirs(ray_tmp), third.stdout
    assert "done: 1 ok, 0 error, 2 skipped (already committed)" in third.stdout.splitlines()[-1], third.stdout
    again = read_output(run_dir)
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in rows)
    assert {r["id"]: r["answer"] for r in again if r["id"] not in lost} == \
        {r["id"]: r["answer"] for r in rows if r["id"] not in lost}


def _plan(tmp_path, n: int, **extra):
    """The checked plan of a job over `n` local image paths (a JSONL manifest; nothing needs to exist but the
    checkpoint), as `vlbatch run` has it before Ray starts."""
    import json

    from vlbatch.pipeline.config import load_config
    from vlbatch.pipeline.plan.cluster import local_cluster
    from vlbatch.pipeline.plan.preflight import preflight

    man = tmp_path / "m.jsonl"
    man.write_text("".join(json.dumps({"media_uri": str(tmp_path / f"i{i}.png")}) + "\n" for i in range(n)))
    return man, lambda ckpt, *sets: preflight(load_config(_yaml(tmp_path, ckpt, man), list(sets)), local_cluster())


def _yaml(tmp_path: Path, ckpt, man: Path) -> Path:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {{path: {ckpt}, dtype: float32, device: cpu}}\n"
                   f"input: {{uri: {man}, format: jsonl}}\n"
                   "task: {mode: questions, questions: ['A?', 'B?']}\n"
                   f"output: {{uri: {tmp_path / 'out'}, run_id: r}}\nmax_error_fraction: 0.5\n")
    return cfg


def _commit(run_dir: Path, ids: list[str], error_type: str | None = None) -> None:
    rows = {"id": ids, "status": ["ok" if error_type is None else "error"] * len(ids),
            "error_type": [error_type] * len(ids), "run_id": ["r"] * len(ids), "request_index": [0] * len(ids),
            "media_type": ["image"] * len(ids), "prompt": ["A?"] * len(ids), "model": ["m"] * len(ids)}
    table = pa.table({f.name: pa.array(rows.get(f.name, [None] * len(ids)), f.type) for f in OUTPUT_SCHEMA},
                     schema=OUTPUT_SCHEMA)
    sink = ParquetSink(str(run_dir))
    sink.prepare()
    sink.commit(table)


def _ids(plan) -> list[str]:
    from vlbatch.pipeline.startup.nothing_to_do import block_ids

    return [rid for b in plan.source.driver_blocks() for rid in block_ids(b, plan.cfg.task)]


def test_the_decision_counts_ok_and_permanent_rows_and_redoes_transient_ones(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.startup.nothing_to_do import nothing_to_do

    ckpt = tiny_ckpt("dense")
    _, make = _plan(tmp_path, 3)
    plan = make(ckpt)
    run_dir = tmp_path / "out" / "r"
    assert nothing_to_do(plan) is None  # a fresh run: work
    ids = _ids(plan)
    assert len(ids) == 6
    _commit(run_dir, ids[:5])
    assert nothing_to_do(plan) is None  # one request left
    _commit(run_dir, ids[5:], "EngineError")  # transient: retried on resume, so work is left
    assert nothing_to_do(plan) is None
    assert nothing_to_do(make(ckpt, "resume.retry_transient=false")) is not None  # ... unless not retried
    for p in run_dir.glob("part-*.parquet"):
        p.unlink()
    _commit(run_dir, ids[:5])
    _commit(run_dir, ids[5:], "InputError")  # permanent: done
    done = nothing_to_do(plan)
    assert done is not None and done.requests == 6 and done.exit_code == 0, done
    assert done.line() == (f"[vlbatch] nothing to do: all 6 requests of {run_dir}/ are committed; 1 error row: "
                           "17% <= max_error_fraction 50%, 1 < min_error_rows 10: errors stayed under the limits")
    # 1 of 6 errors: the run's verdict kept, by the run's count-aware rule (past both limits) and in its words
    small = nothing_to_do(make(ckpt, "max_error_fraction=0.1"))
    assert small is not None and small.exit_code == 0, small
    assert small.line().endswith("; 1 error row: 17% > max_error_fraction 10%, 1 < min_error_rows 10: "
                                 "exit 0 (a run fails only past both)"), small.line()
    failed = nothing_to_do(make(ckpt, "max_error_fraction=0.1", "min_error_rows=1"))
    assert failed is not None and failed.exit_code == 1, failed
    assert failed.line().endswith("1 >= min_error_rows 1: failed"), failed.line()
    assert nothing_to_do(make(ckpt, "input.limit=2")).requests == 4  # the limit's rows only
    assert nothing_to_do(make(ckpt, "resume.enabled=false")) is None  # refused in run_job, as today


def test_covered_refuses_an_id_twice_only_with_kept_columns():
    """With `input.columns.keep` an id seen twice may get ids of its own in the Ray blocks (the kept values
    differ): the driver cannot tell, so it says nothing (None: Ray decides). Without kept columns a repeated
    request is one id, counted once."""
    from vlbatch.operators.sink.ids import IdIndex
    from vlbatch.pipeline.config import TaskSection
    from vlbatch.pipeline.sources.base import manifest_table
    from vlbatch.pipeline.startup.nothing_to_do import block_ids, covered

    task = TaskSection(prompt="Describe.")
    blocks = [manifest_table(2, media_uri=["/a.png", "/b.png"]), manifest_table(1, media_uri=["/a.png"])]
    done = IdIndex.of([rid for b in blocks for rid in block_ids(b, task)])
    assert len(done) == 2
    assert covered(iter(blocks), task, done, limit=None, keep=False) == 2
    assert covered(iter(blocks), task, done, limit=None, keep=True) is None
    assert covered(iter(blocks), task, done, limit=2, keep=True) == 2  # the repeat is past the limit
    assert covered(iter(blocks), task, IdIndex.of(block_ids(blocks[1], task)), limit=None, keep=False) is None
