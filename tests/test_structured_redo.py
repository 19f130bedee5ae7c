"""Issue 52: a `TruncatedError` row (a structured answer cut by `sampling.max_tokens`) is kept on resume
unless `max_tokens` grows: a rerun under a pinned run id with a larger `max_tokens` computes it again (its
old row purged, the path transient error rows take), an equal or smaller one keeps it; the driver's
nothing-to-do check does not claim "nothing to do" while such rows would be redone."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

DIGITS = "[0-9]{6}"  # six digit tokens (the Qwen tokenizer splits digits one by one): never whole in 2 tokens


def _rows(**cols) -> pa.Table:
    n = len(cols["id"])
    base = {"status": ["error"] * n, "error_type": ["TruncatedError"] * n, "finish_reason": ["length"] * n,
            "generated_tokens": [2] * n}
    return pa.table({**base, **cols})


def test_truncated_rows_are_redone_only_below_the_new_max_tokens():
    from vlbatch.operators.sink.base import build_index, truncated_below

    t = _rows(id=["a", "b", "c", "d", "e", "f"],
              status=["error", "error", "error", "ok", "error", "error"],
              error_type=["TruncatedError", "TruncatedError", "TruncatedError", None, "TruncatedError",
                          "EngineError"],
              finish_reason=["length", "length", "stop", "length", "length", None],
              generated_tokens=[2, 8, 2, 2, None, None])
    # a: cut at 2 tokens; b: at 8; c: cut by a stop string (more tokens change nothing); d: an ok row;
    # e: no token count recorded (kept); f: transient (redone anyway)
    assert truncated_below(t, 4).tolist() == [True, False, False, False, False, False]
    assert truncated_below(t, None).tolist() == [False] * 6
    for max_tokens, redone in ((None, {"f"}), (2, {"f"}), (1, {"f"}), (4, {"a", "f"}), (9, {"a", "b", "f"})):
        idx = build_index([("p0", t)], max_tokens=max_tokens)
        assert idx.purgeable_ids == redone and idx.transient_ids == redone, max_tokens
        assert idx.done_ids == {"a", "b", "c", "d", "e", "f"} - redone, max_tokens


def test_parquet_sink_purges_the_truncated_rows_it_redoes(tmp_path):
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.operators.sink.schema import OutputRow, rows_to_table

    def row(i, toks):
        return OutputRow(id=f"id{i}", request_index=0, media_uri=f"m{i}.png", media_type="image", prompt="Year?",
                         status="error", model="m", run_id="r", prompt_name="year", error_type="TruncatedError",
                         error_message="cut", generated_tokens=toks, finish_reason="length")

    sink = ParquetSink(str(tmp_path / "r"))
    sink.prepare()
    sink.commit(rows_to_table([row(0, 2), row(1, 16)]))
    assert sink.index().purgeable_ids == frozenset()  # no max_tokens given: every TruncatedError row is kept
    idx = sink.index(max_tokens=8)
    assert idx.purgeable_ids == {"id0"} and idx.done_ids == {"id1"}
    assert sink.purge(idx.purgeable_ids) == 0  # the purge follows the same rule: without it, kept
    assert sink.purge(idx.purgeable_ids, max_tokens=8) == 1
    assert sink.read().column("id").to_pylist() == ["id1"]


@pytest.mark.slow
@pytest.mark.ray
def test_a_larger_max_tokens_redoes_truncated_rows_under_a_pinned_run_id(tmp_path, tiny_ckpt):
    """End to end on a random tiny checkpoint (the grammar, not the model, makes the value): max_tokens=2 cuts
    every 6-digit answer; the same config again is nothing to do (kept); max_tokens=12 redoes exactly those
    rows (now ok and parsed), the free-text rows stay as they were (2 tokens, not recomputed)."""
    from test_jobs_support import read_output, vlbatch, write_job

    work = tmp_path / "job"
    cfg = write_job(work, tiny_ckpt("dense"), n_images=2, max_tokens=2, extra="")
    task = {"mode": "questions", "questions": [
        "Describe.", {"name": "code", "prompt": "Code?", "response_format": {"type": "regex", "pattern": DIGITS}}]}
    cfg.write_text(cfg.read_text().replace("task: {prompt: Describe.}", "task: " + json.dumps(task)))
    pin = ["--set", "output.run_id=pinned"]
    run_dir = tmp_path / "output" / "pinned"

    first = vlbatch("run", str(cfg), *pin, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    rows = {r["id"]: r for r in read_output(run_dir)}
    cut = {i for i, r in rows.items() if r["prompt_name"] == "code"}
    assert len(rows) == 4 and len(cut) == 2
    assert all(rows[i]["error_type"] == "TruncatedError" and rows[i]["generated_tokens"] == 2 for i in cut), rows

    same = vlbatch("run", str(cfg), *pin, timeout=600)  # an equal max_tokens keeps them: nothing to do
    assert same.returncode == 0 and "nothing to do" in same.stdout + same.stderr, same.stdout + same.stderr
    assert {i: r["error_type"] for i, r in ((r["id"], r) for r in read_output(run_dir))} == {
        i: r["error_type"] for i, r in rows.items()}

    grown = vlbatch("run", str(cfg), *pin, "--set", "sampling.max_tokens=12", "--allow-config-change", timeout=600)
    out = grown.stdout + grown.stderr
    assert grown.returncode == 0 and "nothing to do" not in out, out[-3000:]
    after = {r["id"]: r for r in read_output(run_dir)}
    assert set(after) == set(rows)  # one row per id: the new rows replaced the truncated ones
    for i in cut:
        assert after[i]["status"] == "ok" and len(json.loads(after[i]["parsed"])) == 6, after[i]
    for i in set(rows) - cut:  # free text: kept from the first run, not computed again at 12 tokens
        assert after[i] == rows[i]
    summary = json.loads((run_dir / "_summary.json").read_text())
    assert summary["requests_skipped"] == 2, summary


def test_the_refusal_of_a_grown_max_tokens_says_truncated_rows_are_redone():
    from vlbatch.pipeline.plan.fingerprint import refusal

    grown = refusal("r", {"sampling.max_tokens": [2, 12]})
    assert "--allow-config-change" in grown and "TruncatedError rows" in grown and grown.endswith("computed again)")
    assert "TruncatedError" not in refusal("r", {"sampling.max_tokens": [12, 2]})
