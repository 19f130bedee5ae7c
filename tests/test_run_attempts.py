"""A run's attempts (issue 50): `_summary.json` of a finished run says nothing is pending
(`requests_pending` 0; what the call computed is `requests_computed`), keeps every attempt's record
(rows, ok / error, seconds, rows/s, when) across resumes, and `vlbatch inspect` shows the whole run
attempt by attempt, in the terminal and on the page (headline first, the fingerprint folded away).

One real run and one resume through the CLI (each joining the session's Ray, tests/conftest.py; a tiny
checkpoint, three generated images); between them one committed row is turned into a transient `EngineError` row
(what an actor's death leaves), so the resume computes exactly that request."""
from __future__ import annotations

import html
import json
import re
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from test_jobs_support import read_output, vlbatch, write_job

from vlbatch.operators.sink.parquet import ParquetSink

pytestmark = pytest.mark.ray


def _make_transient(run_dir, victim: str) -> None:
    sink = ParquetSink(str(run_dir))
    for part in sink.parts():
        t = sink.read_part(part)
        hit = pc.equal(t["id"], victim)
        if not pc.any(hit).as_py():
            continue
        for name, value in (("status", "error"), ("error_type", "EngineError")):
            t = t.set_column(t.schema.get_field_index(name), name, pc.if_else(hit, pa.scalar(value), t[name]))
        sink.fs.rm_file(part)
        sink.commit(t)


def _when(stamp: str) -> datetime:
    t = datetime.fromisoformat(stamp)
    assert t.utcoffset() is not None and t.utcoffset().total_seconds() == 0, stamp  # UTC, explicit
    return t


def test_resume_keeps_every_attempt_and_inspect_shows_the_whole_run(tmp_path, tiny_ckpt):
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=3, write_batch=4)
    pin = ["--set", "output.run_id=attempts"]
    run_dir = tmp_path / "output" / "attempts"
    first = vlbatch("run", str(cfg), "--no-lock", *pin, timeout=400)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    one = json.loads((run_dir / "_summary.json").read_text())
    assert one["requests_pending"] == 0 and one["requests_computed"] == 3, one  # finished: nothing pending
    [a1] = one["attempts"]
    assert (a1["attempt"], a1["rows"], a1["ok"], a1["error"], a1["skipped"]) == (1, 3, 3, 0, 0), a1
    assert a1["elapsed_s"] == one["elapsed_s"] and a1["rows_per_s"] == one["rows_per_s"]
    assert _when(a1["started_at"]) <= _when(a1["finished_at"])

    _make_transient(run_dir, read_output(run_dir)[0]["id"])
    second = vlbatch("run", str(cfg), "--no-lock", *pin, timeout=400)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    two = json.loads((run_dir / "_summary.json").read_text())
    assert two["requests_pending"] == 0 and two["requests_computed"] == 1 and two["purged_transient"] == 1, two
    assert [a["attempt"] for a in two["attempts"]] == [1, 2] and two["attempts"][0] == a1  # the first one kept
    a2 = two["attempts"][1]
    assert (a2["rows"], a2["ok"], a2["error"], a2["skipped"]) == (1, 1, 0, 2), a2
    assert _when(a1["finished_at"]) <= _when(a2["started_at"]) <= _when(a2["finished_at"])

    page = tmp_path / "report.html"
    shown = vlbatch("inspect", str(run_dir), "--sample", "0", "--html", str(page), timeout=300)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "throughput (the last call)" not in out and "attempt 2, the last: " in out
    for a in (a1, a2):  # each attempt: its rows, ok / error, seconds, rows/s, when
        stamp = _when(a["started_at"]).strftime("%Y-%m-%d %H:%M:%S")
        assert re.search(rf"^\s+{a['attempt']}  {stamp}\s+{a['rows']}\s+{a['ok']}\s+{a['error']}\s+{a['skipped']}\s+"
                         rf"{a['elapsed_s']:.1f}\s+{a['rows_per_s']:.2f}$", out, re.M), out
    total_s = a1["elapsed_s"] + a2["elapsed_s"]
    assert re.search(rf"^\s+whole run\s+4\s+4\s+0\s+{total_s:.1f}\s+{4 / total_s:.2f}$", out, re.M), out

    page_html = page.read_text()
    header = re.search(r"<header>(.*?)</header>", page_html, re.S).group(1)
    headline = html.unescape(re.sub(r"<[^>]+>", " ", header.split("<details", 1)[0]))
    model = read_output(run_dir)[0]["model"]
    for want in ("3 rows", "3 ok", "0 error", "2 attempts", f"{4 / total_s:.2f} rows/s", f"model {model}"):
        assert want in headline, (want, headline)
    assert _when(a2["finished_at"]).strftime("%Y-%m-%d %H:%M") in headline, headline
    fp = re.search(r"<details[^>]*>\s*<summary>([^<]*)</summary>(.*?)</details>", header, re.S)
    assert fp and "fingerprint" in fp.group(1) and "model.path" in fp.group(2), header  # folded away, still there
    attempts = re.search(r'<table class="attempts">(.*?)</table>', page_html, re.S)
    assert attempts and len(re.findall(r"<tr class=\"attempt\">", attempts.group(1))) == 2, page_html[:3000]
