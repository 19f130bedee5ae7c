"""Issue 60 item 12: the throughput plot covers every attempt of a run. Each summary keeps `run_timeline`:
the earlier calls' timeline, then this call's (`timeline.concat`: the wider bucket width, bounded)."""
from __future__ import annotations

import json

from vlbatch.jobs.inspect.run import rates, run_attempts
from vlbatch.pipeline.telemetry.attempts import with_attempts
from vlbatch.pipeline.telemetry.summary import RunSummary
from vlbatch.pipeline.telemetry.timeline import FIELDS, concat


def _tl(width: float, rows: list[int]) -> dict:
    return {"bucket_s": width, "started_at": 1.0, "fields": list(FIELDS),
            "buckets": [[r] + [0] * (len(FIELDS) - 1) for r in rows]}


def test_concat_puts_the_second_after_the_first_at_the_wider_width():
    out = concat(_tl(1.0, [1, 2, 3]), _tl(2.0, [4, 5]))
    assert out["bucket_s"] == 2.0 and [b[0] for b in out["buckets"]] == [3, 3, 4, 5]
    assert concat(None, _tl(1.0, [7]))["buckets"] == [[7] + [0] * (len(FIELDS) - 1)]
    assert concat({"bucket_s": "x"}, {"fields": ["rows"]}) == {}  # not timelines: left out


def test_concat_stays_bounded():
    out = concat(_tl(1.0, [1] * 200), _tl(1.0, [1] * 200), max_points=240)
    assert out["bucket_s"] == 2.0 and len(out["buckets"]) == 200 and sum(b[0] for b in out["buckets"]) == 400


def test_each_summary_appends_its_call_and_inspect_plots_them_all():
    first = RunSummary("r", "/o/r", 5, 0, timeline=_tl(1.0, [2, 2]), processed_by_status={"ok": 4})
    text = with_attempts(first, None, ended="interrupted").to_json()
    second = RunSummary("r", "/o/r", 0, 4, timeline=_tl(1.0, [1, 0, 4]), processed_by_status={"ok": 5})
    data = json.loads(with_attempts(second, text).to_json())
    assert [(a["attempt"], a["ended"]) for a in data["attempts"]] == [(1, "interrupted"), (2, "finished")]
    assert [b[0] for b in data["run_timeline"]["buckets"]] == [2, 2, 1, 0, 4]
    assert [r[1] for r in rates(data)] == [2, 2, 1, 0, 4]  # rows/s of both calls, one after the other
    assert [a.ended for a in run_attempts(data)] == ["interrupted", "finished"]


def test_a_stopped_calls_rows_published_by_its_tidy_up_are_in_its_timeline():
    """A SIGINT: the writers' staged batches are published by the stop's tidy-up, no stats block of theirs
    reached the driver; the stopped call's timeline counts them in the bucket of the stop (its summary's rows)."""
    import pyarrow as pa

    from vlbatch.pipeline.telemetry.timeline import TOKEN_FIELDS, Timeline

    now = [0.0]
    t = Timeline(clock=lambda: now[0])
    t.update(pa.table({"status": ["ok", "error"], **{k: [1, 1] for k in TOKEN_FIELDS}}))
    now[0] = 3.5
    t.settle(rows=6, errors=2)  # 4 more published at the stop, 1 of them an error row
    rows = [b[FIELDS.index("rows")] for b in t.to_json()["buckets"]]
    errors = [b[FIELDS.index("errors")] for b in t.to_json()["buckets"]]
    assert rows == [2, 0, 0, 4] and errors == [1, 0, 0, 1]
    t.settle(rows=5, errors=0)  # never fewer than it saw
    assert sum(b[0] for b in t.to_json()["buckets"]) == 6
