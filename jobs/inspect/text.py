"""`vlbatch inspect RUN` in the terminal: the report `print_report` writes, and the command (`run_inspect`).

Sections: the run's identity (its fingerprint, else run id and model), counts by status, error types
with one example message each, token histograms (power-of-two buckets), throughput over the run
(each attempt: a call of `vlbatch run`, a resume; then the whole run; sparklines of rows/s and
tokens/s over every attempt, one after another: `run_timeline`), a clipped run's video timelines
(`clips.print_timelines`: one line per clip), then the sampled media, a card each (`cards`: the
caption, then each prompt with its answer, parsed value or error). The data comes from
`vlbatch.jobs.inspect.run.read_run`; `--html` adds the page (`vlbatch.jobs.inspect.html`). Answers are
untrusted text: control characters (a terminal escape sequence) are shown escaped (`_one_line`).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TextIO

import numpy as np

from vlbatch.jobs.inspect.clips import print_timelines
from vlbatch.jobs.inspect.run import (
    TOKENS,
    Attempt,
    RunReport,
    fingerprint_lines,
    hist_key,
    parse_where,
    rates,
    read_run,
    resolve_run,
    run_attempts,
    when,
    whole_run,
)
from vlbatch.jobs.run_logs import run_log_dir
from vlbatch.operators.errors import ConfigError

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """Values as one line of block characters (averaged down to `width` columns)."""
    if not values:
        return ""
    chunks = np.array_split(np.asarray(values, dtype=float), min(width, len(values)))
    v = np.array([c.mean() for c in chunks])
    top = v.max() or 1.0
    return "".join(SPARK[int(round(x / top * (len(SPARK) - 1)))] for x in v)


def _bar(n: int, top: int, width: int = 30) -> str:
    return "█" * max(1, round(n / top * width)) if n else ""


def print_report(rep: RunReport, out: TextIO) -> None:
    """The terminal report: identity, counts, errors, token histograms, throughput, sample rows."""
    w = out.write
    w(f"run {rep.ref.uri}: {rep.rows} rows in {rep.parts} Parquet files\n")
    for folder in log_folders(rep):
        w(f"  logs on this machine: {folder}\n")
    for line in fingerprint_lines(rep):
        w(f"  {line}\n")
    status = sorted(rep.status.items(), key=lambda x: (x[0] != "ok", x[0]))
    w("\nstatus: " + (", ".join(f"{n} {s}" for s, n in status) or "no rows") + "\n")
    if rep.errors:
        w("errors by type (one example each):\n")
        width = max(len(t) for t in rep.errors)
        for et, n in sorted(rep.errors.items(), key=lambda x: (-x[1], x[0])):
            w(f"  {et:<{width}} {n:>7}  e.g. {_one_line(rep.examples.get(et, ''))}\n")
    _print_quality(rep, w)
    w("\ntokens per request (requests in each power-of-two bucket):\n")
    for name in TOKENS:
        h = rep.hist[name]
        w(f"  {name}:{'' if h else ' none recorded'}\n")
        top = max(h.values(), default=0)
        for label in sorted(h, key=hist_key):
            w(f"    {label:>11} {h[label]:>7} {_bar(h[label], top)}\n")
    _print_throughput(rep.summary, w)
    print_timelines(rep.timelines, w, _one_line)
    _print_sample(rep, w)


def _print_quality(rep: RunReport, w) -> None:
    """Ok answers per quality flag, with an example answer of each (operators/quality.py)."""
    if not rep.quality:
        return
    ok = rep.status.get("ok", 0)
    w("answer quality flags (ok answers; examples):\n")
    for flag, n in sorted(rep.quality.items(), key=lambda x: (-x[1], x[0])):
        ex = rep.quality_rows.get(flag) or [{}]
        w(f"  {flag:<10} {n:>7} ({n / max(ok, 1):.1%})  e.g. {ex[0].get('media_uri') or ''}: "
          f"{_one_line(repr(ex[0].get('answer') or ''))}\n")


def log_folders(rep: RunReport) -> list[Path]:
    """The run's own log folders (jobs/run_logs.py) that exist on this machine."""
    found = []
    for run_id, _ in rep.run_ids.most_common(3):
        with contextlib.suppress(ValueError):  # not a single path segment: no folder of ours
            if run_log_dir(run_id).is_dir():
                found.append(run_log_dir(run_id))
    return found


# C0 / C1 control characters (ESC starts a terminal escape sequence) shown as \\xNN, never sent to the terminal
CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join((text or "").split()).translate(CONTROLS)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _print_throughput(summary: dict | None, w) -> None:
    if summary is None:
        w("\nthroughput: no _summary.json (the run has not finished a call)\n")
        return
    attempts = run_attempts(summary)
    _print_attempts(attempts, w)
    last = f"attempt {attempts[-1].number}, the last" if summary.get("attempts") else "the last call"
    w(f"{last}: {summary.get('rows_per_s', 0):.2f} rows/s, "
      f"{summary.get('generated_tokens_per_s', 0):.1f} generated tok/s, "
      f"{summary.get('visual_tokens_per_s', 0):.0f} visual tok/s over {summary.get('elapsed_s', 0):.1f} s")
    first, steady = summary.get("time_to_first_row_s"), summary.get("steady_rows_per_s")
    if first is not None:
        w(f"; first row after {first:.1f} s")
    if steady is not None:
        w(f"; steady {steady:.2f} rows/s")
    w("\n")
    series = rates(summary)
    if not series:
        w("  no timeline recorded\n")
        return
    span = series[-1][0] + series[0][0]
    if len(attempts) > 1 and summary.get("run_timeline"):
        w(f"  over the whole run ({len(attempts)} attempts, one after another):\n")
    for label, col in (("rows/s", 1), ("generated tok/s", 2), ("visual tok/s", 3)):
        vals = [s[col] for s in series]
        w(f"  {label:>15} {sparkline(vals)}  peak {max(vals):.1f}\n")
    w(f"  {'':>15} 0 s{'':>{max(0, min(60, len(series)) - 8)}}{span:.0f} s\n")


def _print_attempts(attempts: list[Attempt], w) -> None:
    """The run attempt by attempt (each call of `vlbatch run`: the requests it computed), then the whole run."""
    total = whole_run(attempts)
    w(f"\nthroughput over the whole run: {len(attempts)} attempt{'s' if len(attempts) != 1 else ''}, "
      f"{total.rows} rows computed in {total.seconds:.1f} s, {total.rows_per_s:.2f} rows/s\n")
    w(f"  {'#':>4}  {'started (UTC)':<19}  {'rows':>7} {'ok':>7} {'error':>7} {'skipped':>8} {'seconds':>8} "
      f"{'rows/s':>7}\n")
    for a in attempts:
        ended = f"  {a.ended}" if a.ended not in (None, "finished") else ""
        w(f"  {a.number:>4}  {when(a.started):<19}  {a.rows:>7} {a.ok:>7} {a.error:>7} {a.skipped:>8} "
          f"{a.seconds:>8.1f} {a.rows_per_s:>7.2f}{ended}\n")
    w(f"  {'':>4}  {'whole run':<19}  {total.rows:>7} {total.ok:>7} {total.error:>7} {'':>8} {total.seconds:>8.1f} "
      f"{total.rows_per_s:>7.2f}\n")


def _print_sample(rep: RunReport, w) -> None:
    """The sampled media, one card each (`cards`): the caption, then each prompt with its answer,
    a structured answer's parsed value as `key: value` lines, or its error."""
    from vlbatch.jobs.inspect.cards import cards

    cond = " and ".join(f"{c}={v}" for c, v in rep.where)
    sampled = cards(rep.sample)
    w(f"\nsample: {len(sampled)} media ({len(rep.sample)} rows) of {rep.matched} rows"
      f"{' where ' + cond if cond else ''} (seed {rep.seed})\n")
    for i, card in enumerate(sampled, 1):
        w(f"[{i}] {card.media_uri or '(no media_uri)'}  {card.media_type}, {card.status_text()}\n")
        for a in card.answers:
            r = a.row
            toks = "/".join("-" if r.get(f"{k}_tokens") is None else str(r[f"{k}_tokens"]) for k in TOKENS)
            w(f"    {_one_line(a.label, 80)}: {_one_line(r.get('prompt') or '')}  ({r.get('status')}, "
              f"tokens prompt/visual/generated {toks})\n")
            if not a.ok:
                w(f"      error:  {r.get('error_type')}: {_one_line(r.get('error_message') or '', 400)}\n")
            elif a.items is None:
                w(f"      answer: {_one_line(r.get('answer') or '', 400)}\n")
            else:
                w("".join(f"      {_one_line(k, 80)}: {_one_line(v, 400)}\n" for k, v in a.items))


def run_inspect(target: str, *, sample: int = 8, where: list[str] | None = None, seed: int = 0,
                html: str | None = None, endpoint_url: str | None = None, out: TextIO | None = None) -> int:
    """`vlbatch inspect`: the report on `out` (stdout), the page at `html`; exit code 0, or 2 when RUN
    cannot be read as a run (one line on stderr)."""
    import sys

    from vlbatch.operators.errors import VlbatchError

    out = out or sys.stdout
    try:
        if sample < 0:
            raise ConfigError(f"--sample must be 0 or more, got {sample}")
        rep = read_run(resolve_run(target, endpoint_url), sample=sample, where=parse_where(where), seed=seed)
    except VlbatchError as e:
        print(f"vlbatch inspect: {e}", file=sys.stderr)
        return 2
    print_report(rep, out)
    if html:
        from vlbatch.jobs.inspect.html import write_html

        print(f"\nwrote {write_html(rep, html)}", file=out)
    return 0
