"""Scheduling: schedule slots, deterministic submission ids, and the local overlap lock.

A scheduled job runs once per *slot*: the scheduled time a tick belongs to. A cron tick
that fires late, or is retried, or an Airflow task retry, computes the same slot and so
the same submission id (`submission_id(name, slot)`); the cluster refuses a second
submission with that id (see `vlbatch.jobs.submission`). Locally, `run_lock(name)` holds an
exclusive `flock` for the job name while a run is active, so two cron ticks of the same
job never overlap on one machine; the lock disappears with the process (no stale locks
after a crash, unlike pid files).

Cron expressions are the standard five fields (minute hour day-of-month month
day-of-week) with `*`, lists `a,b`, ranges `a-b` and steps `*/n`, `a-b/n`; day-of-week 0
or 7 is Sunday. As in cron, when both day fields are restricted a day matches if either
matches. Times are UTC.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vlbatch.jobs.errors import OverlapError, SubmissionError

_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7))
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class CronSchedule:
    """A parsed five-field cron expression; each field is the set of allowed values."""

    expr: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday .. 6 = Saturday
    day_restricted: bool
    weekday_restricted: bool

    def matches_day(self, d: dt.date) -> bool:
        if d.month not in self.months:
            return False
        dom = d.day in self.days
        dow = (d.isoweekday() % 7) in self.weekdays
        if self.day_restricted and self.weekday_restricted:
            return dom or dow
        return dom and dow


def _parse_field(text: str, name: str, lo: int, hi: int) -> tuple[frozenset[int], bool]:
    values: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"(\*|\d+(?:-\d+)?)(?:/(\d+))?", part)
        if not m:
            raise SubmissionError(f"schedule: {name} field {text!r} is not cron syntax (use *, a, a-b, */n, a,b)")
        rng, step = m.group(1), int(m.group(2) or 1)
        a, b = (lo, hi) if rng == "*" else (int(rng.split("-")[0]), int(rng.split("-")[-1]))
        if not (lo <= a <= b <= hi) or step < 1:
            raise SubmissionError(f"schedule: {name} field {text!r} is outside {lo}-{hi}")
        values.update(range(a, b + 1, step))
    return frozenset(values), text != "*"


def parse_cron(expr: str) -> CronSchedule:
    parts = expr.split()
    if len(parts) != 5:
        raise SubmissionError(f"schedule {expr!r}: expected 5 cron fields (minute hour day month weekday)")
    parsed = [_parse_field(p, name, lo, hi) for p, (name, lo, hi) in zip(parts, _FIELDS, strict=True)]
    weekdays = frozenset(d % 7 for d in parsed[4][0])
    return CronSchedule(
        expr=expr,
        minutes=parsed[0][0],
        hours=parsed[1][0],
        days=parsed[2][0],
        months=parsed[3][0],
        weekdays=weekdays,
        day_restricted=parsed[2][1],
        weekday_restricted=parsed[4][1],
    )


def latest_slot(expr: str, now: dt.datetime, *, horizon_days: int = 366 * 4) -> dt.datetime:
    """The latest scheduled time <= `now` (UTC, minute resolution).

    Searches day by day backwards, then the latest matching hour and minute, so a yearly
    schedule costs at most a few thousand day checks.
    """
    sched = parse_cron(expr)
    now = now.astimezone(dt.UTC).replace(second=0, microsecond=0)
    for back in range(horizon_days + 1):
        day = now.date() - dt.timedelta(days=back)
        if not sched.matches_day(day):
            continue
        for hour in sorted(sched.hours, reverse=True):
            for minute in sorted(sched.minutes, reverse=True):
                t = dt.datetime(day.year, day.month, day.day, hour, minute, tzinfo=dt.UTC)
                if t <= now:
                    return t
    raise SubmissionError(f"schedule {expr!r} has no time in the last {horizon_days} days")


def format_slot(t: dt.datetime) -> str:
    """Slot text used in ids: ``YYYYMMDDTHHMM`` (UTC)."""
    return t.astimezone(dt.UTC).strftime("%Y%m%dT%H%M")


MAX_ID = 128  # output.run_id's limit (pipeline/config/schema.py): a slot's id is also its run id


def submission_id(job_name: str, slot: str) -> str:
    """Deterministic Ray submission id for one slot of one job: ``vlb-<name>-<slot>``.

    Characters other than letters, digits, ``.``, ``_`` and ``-`` become ``-`` so the id is
    safe in URLs, file names and Kubernetes labels' spirit; the same inputs always give
    the same id. An id over `MAX_ID` characters (a long ``--name``) keeps the slot and the
    name's start, with a hash of the whole id between them (``vlb-<name...>-<12 hex>-<slot>``),
    so it is still a valid run id and still one per name and slot.
    """
    name = _ID_UNSAFE.sub("-", job_name).strip("-")
    s = _ID_UNSAFE.sub("-", slot).strip("-")
    if not name or not s:
        raise SubmissionError(f"job name {job_name!r} and slot {slot!r} must contain letters or digits")
    full = f"vlb-{name}-{s}"
    if len(full) <= MAX_ID:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:12]
    keep = MAX_ID - len("vlb---") - len(digest) - len(s)
    if keep < 8:  # a slot that long: the hash stands for the rest
        return f"{full[:MAX_ID - len(digest) - 1]}-{digest}"
    return f"vlb-{name[:keep].rstrip('-')}-{digest}-{s}"


def default_lock_dir() -> Path:
    return Path(os.environ.get("VLBATCH_LOCK_DIR") or Path.home() / ".cache" / "vlbatch" / "locks")


@contextlib.contextmanager
def run_lock(job_name: str, lock_dir: Path | None = None) -> Iterator[Path]:
    """Hold an exclusive, non-blocking flock on ``<lock_dir>/<job_name>.lock``.

    Raises `OverlapError` (naming the holder's pid) when another process holds it. The
    kernel releases the lock when the holder exits, however it exits.
    """
    d = lock_dir or default_lock_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{_ID_UNSAFE.sub('-', job_name)}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise OverlapError(
                f"job {job_name!r} is already running (lock {path} held by pid {holder}); "
                "this run was not started"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the flock
