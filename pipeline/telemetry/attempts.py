"""A run's attempts: every `run_job` call on one run directory, kept in its `_summary.json`.

`_summary.json` is rewritten by each call (a resume, a rerun after a stop), so what it says of rows,
seconds and rows/s is that call's alone. Each call's record is kept in its `attempts` list, written
by the same atomic write as the rest of the summary (`with_attempts`: the earlier records read from
the summary it replaces, this call's appended). A record (a dict, as JSON holds it):

    {"attempt": 2, "started_at": "2026-12-05T01:02:03+00:00", "finished_at": "...", "elapsed_s": 15.2,
     "rows": 1, "ok": 1, "error": 0, "skipped": 2, "rows_per_s": 0.07, "ended": "finished"}

`rows` / `ok` / `error`: the requests this call computed, by status; `skipped`: those already
committed before it; times in UTC to the second; `ended`: "finished", or "interrupted" (SIGINT /
SIGTERM) / "failed" for a call that stopped mid-run: the runner writes the summary of such a call
too (`pipeline/graph.py`), its rows those its writers took (published by the stop's tidy-up), so a
resume lists it. A summary written before attempts were recorded counts as one attempt of unknown
time (`started_at` / `finished_at` None). `run_timeline`: every call's throughput timeline, one
after another (`timeline.concat`, bounded like one), which `vlbatch inspect` plots; it shows the list
(`jobs/inspect/text.py`, `jobs/inspect/html.py`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from vlbatch.pipeline.telemetry.timeline import concat

log = logging.getLogger("vlbatch.pipeline")

MAX_ATTEMPTS = 1000  # records kept (the latest; `attempt` numbers stay absolute): ~200 B each
FIELDS = ("attempt", "started_at", "finished_at", "elapsed_s", "rows", "ok", "error", "skipped", "rows_per_s", "ended")
ENDINGS = ("finished", "interrupted", "failed")


def stamp(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="seconds")


def record(summary, number: int, finished: datetime, ended: str = "finished") -> dict:
    """The attempt record of `summary` (a `RunSummary` or its JSON dict), the call numbered `number`
    that finished at `finished` (`ended`: how, one of `ENDINGS`); its start is `elapsed_s` before."""
    get = summary.get if isinstance(summary, dict) else lambda k, d=None: getattr(summary, k, d)
    by_status = get("processed_by_status") or {}
    elapsed = get("elapsed_s") or 0.0
    return {"attempt": number, "started_at": stamp(finished - timedelta(seconds=elapsed)),
            "finished_at": stamp(finished), "elapsed_s": elapsed, "rows": int(sum(by_status.values())),
            "ok": int(by_status.get("ok", 0)), "error": int(by_status.get("error", 0)),
            "skipped": int(get("requests_skipped") or 0), "rows_per_s": get("rows_per_s") or 0.0, "ended": ended}


def attempts_of(data: dict) -> list[dict]:
    """The attempt records of a parsed `_summary.json`, oldest first."""
    attempts = data.get("attempts")
    if isinstance(attempts, list) and attempts:  # every summary the runner writes has its own record
        return [a for a in attempts if isinstance(a, dict)]
    try:  # written before attempts were recorded: its time is unknown
        old = record(data, 1, datetime.now(UTC))
    except (TypeError, ValueError, AttributeError, OverflowError):  # not a summary this code wrote
        return []
    return [{**old, "started_at": None, "finished_at": None}]


def _parsed(previous: str | None) -> dict:
    """The summary text `previous` as a dict ({}: none yet, the first call, or not a summary)."""
    if not previous:
        return {}
    try:
        data = json.loads(previous)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.warning("the run's _summary.json is not a JSON object: the earlier attempts' records are lost")
        return {}
    return data


def earlier_attempts(previous: str | None) -> list[dict]:
    """The attempt records of the summary text `previous` (None: no summary yet, the first call)."""
    data = _parsed(previous)
    return attempts_of(data) if data else []


def run_timeline_of(data: dict) -> dict | None:
    """The timeline of every call a parsed summary covers (one written before `run_timeline`: its last call's)."""
    return data.get("run_timeline") or data.get("timeline")


def with_attempts(summary, previous: str | None, now: datetime | None = None, ended: str = "finished"):
    """`summary` (a `RunSummary`) with `attempts`: the records of `previous` (the summary text it
    replaces) and its own (`ended`: how this call ended), numbered after the last of them; and
    `run_timeline`: the earlier calls' timeline, then this call's."""
    data = _parsed(previous)
    earlier = attempts_of(data) if data else []
    last = earlier[-1].get("attempt") if earlier else 0
    number = (last if isinstance(last, int) and not isinstance(last, bool) else len(earlier)) + 1
    mine = record(summary, number, now or datetime.now(UTC), ended)
    return replace(summary, attempts=[*earlier, mine][-MAX_ATTEMPTS:],
                   run_timeline=concat(run_timeline_of(data), summary.timeline))
