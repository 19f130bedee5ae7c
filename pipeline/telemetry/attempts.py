"""A run's attempts: every `run_job` call on one run directory, kept in its `_summary.json`.

`_summary.json` is rewritten by each call (a resume, a rerun after a stop), so what it says of rows,
seconds and rows/s is that call's alone. Each call's record is kept in its `attempts` list, written
by the same atomic write as the rest of the summary (`with_attempts`: the earlier records read from
the summary it replaces, this call's appended). A record (a dict, as JSON holds it):

    {"attempt": 2, "started_at": "2026-12-05T01:02:03+00:00", "finished_at": "...", "elapsed_s": 15.2,
     "rows": 1, "ok": 1, "error": 0, "skipped": 2, "rows_per_s": 0.07}

`rows` / `ok` / `error`: the requests this call computed, by status; `skipped`: those already
committed before it; times in UTC to the second. A summary written before attempts were recorded
counts as one attempt of unknown time (`started_at` / `finished_at` None). `vlbatch inspect` shows
the list (`jobs/inspect_text.py`, `jobs/inspect_html.py`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta

log = logging.getLogger("vlbatch.pipeline")

MAX_ATTEMPTS = 1000  # records kept (the latest; `attempt` numbers stay absolute): ~200 B each
FIELDS = ("attempt", "started_at", "finished_at", "elapsed_s", "rows", "ok", "error", "skipped", "rows_per_s")


def stamp(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="seconds")


def record(summary, number: int, finished: datetime) -> dict:
    """The attempt record of `summary` (a `RunSummary` or its JSON dict), the call numbered `number`
    that finished at `finished`; its start is `elapsed_s` before."""
    get = summary.get if isinstance(summary, dict) else lambda k, d=None: getattr(summary, k, d)
    by_status = get("processed_by_status") or {}
    elapsed = get("elapsed_s") or 0.0
    return {"attempt": number, "started_at": stamp(finished - timedelta(seconds=elapsed)),
            "finished_at": stamp(finished), "elapsed_s": elapsed, "rows": int(sum(by_status.values())),
            "ok": int(by_status.get("ok", 0)), "error": int(by_status.get("error", 0)),
            "skipped": int(get("requests_skipped") or 0), "rows_per_s": get("rows_per_s") or 0.0}


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


def earlier_attempts(previous: str | None) -> list[dict]:
    """The attempt records of the summary text `previous` (None: no summary yet, the first call)."""
    if not previous:
        return []
    try:
        data = json.loads(previous)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.warning("the run's _summary.json is not a JSON object: the earlier attempts' records are lost")
        return []
    return attempts_of(data)


def with_attempts(summary, previous: str | None, now: datetime | None = None):
    """`summary` (a `RunSummary`) with `attempts`: the records of `previous` (the summary text it
    replaces) and its own, numbered after the last of them."""
    earlier = earlier_attempts(previous)
    last = earlier[-1].get("attempt") if earlier else 0
    number = (last if isinstance(last, int) and not isinstance(last, bool) else len(earlier)) + 1
    mine = record(summary, number, now or datetime.now(UTC))
    return replace(summary, attempts=[*earlier, mine][-MAX_ATTEMPTS:])
