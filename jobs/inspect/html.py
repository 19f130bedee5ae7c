"""`vlbatch inspect RUN --html report.html`: the run as one self-contained static page.

No server and nothing fetched: thumbnails are inlined as small JPEGs (`data:` URIs,
`vlbatch.jobs.inspect.thumbnails`), plots are inline SVG, the style is inline CSS. Sections: the run's
headline (rows, ok / error, attempts, rows/s over the whole run, model, when), its fingerprint folded
away (`<details>`), counts; its attempts (each call of `vlbatch run`, an interrupted one marked) and
rows/s and tokens/s over time, every attempt one after another (`run.rates`); token histograms;
the sampled media as cards (`#sample .card`, one per media, `cards`: an image thumbnail or a
video's frame strip beside its caption, then each prompt and its answer, a parsed value as a small
table); the errors grouped by type, each with one example message and a few of its media; a clipped run's
timelines (`#clips .timeline`, a few videos: per clip a frame near its middle, its start-end and caption;
`clips`). A small
inline script records on `<body>` how many thumbnails the browser decoded (`data-thumbs-loaded`), which the tests read.
"""
from __future__ import annotations

import base64
import html
import math
from dataclasses import replace
from pathlib import Path

from vlbatch.jobs.inspect.run import (
    TOKENS,
    Attempt,
    RunReport,
    fingerprint_lines,
    hist_key,
    rates,
    run_attempts,
    when,
    whole_run,
)
from vlbatch.jobs.inspect.thumbnails import Thumb, ThumbOptions, thumbnails

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:18px 28px}header h1{margin:0 0 4px;font-size:20px}
header .where{font:12px ui-monospace,monospace;color:#c7ccd6}main{padding:8px 28px 40px}
h2{font-size:16px;margin:26px 0 10px}.muted{color:#6b7280}.fp{font:12px ui-monospace,monospace;margin-top:6px}
.chips span{display:inline-block;border-radius:12px;padding:2px 10px;margin:8px 6px 0 0;font-weight:600}
.ok{background:#d9f2e3;color:#11693a}.error{background:#fde2e1;color:#a3231b}.other{background:#e5e7eb}
.panel{background:#fff;border-radius:8px;box-shadow:0 1px 2px #0002;padding:12px 16px}
.row{display:flex;gap:16px;flex-wrap:wrap}.hist{flex:1;min-width:220px}.hist table{width:100%;font-size:12px}
.hist td{padding:1px 4px}.hist td.k{width:80px;white-space:nowrap}.hist td.n{text-align:right;width:48px}
.hist .b{background:#6b8fd6;height:10px;border-radius:2px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));grid-auto-flow:dense;gap:14px}
.plots{display:flex;flex-wrap:wrap;gap:8px 24px}
.card{background:#fff;border-radius:8px;box-shadow:0 1px 2px #0002;display:flex;gap:12px;padding:10px;min-width:0}
.card.video{grid-column:1/-1}.card .media{flex:none}.card .text{min-width:0;flex:1}
.media img{display:block;border-radius:4px;max-width:220px;height:auto}
.strip{display:flex;gap:4px}.strip figure{margin:0;text-align:center;font-size:11px;color:#6b7280}
.strip img{max-width:120px}.placeholder{width:160px;height:110px;border-radius:4px;background:repeating-linear-gradient(
45deg,#eceef2,#eceef2 8px,#e2e5ea 8px,#e2e5ea 16px);display:flex;align-items:center;justify-content:center;
text-align:center;font-size:11px;color:#6b7280;padding:6px;box-sizing:border-box;overflow:hidden}
.uri{font:12px ui-monospace,monospace;word-break:break-all;color:#374151}.q{color:#6b7280;margin-top:6px}
.a{margin-top:2px;font-size:15px}.err{color:#a3231b;margin-top:6px;word-break:break-word}
.meta{font-size:11px;color:#6b7280;margin-top:6px}
.badge{font-size:11px;padding:1px 7px;border-radius:8px;margin-left:6px}
.etype{margin-bottom:16px}.etype h3{margin:0 0 4px;font-size:15px}
.emedia{display:flex;gap:10px;flex-wrap:wrap;margin-top:8px}
.emedia .item{width:200px;font-size:11px}.emedia img{max-width:200px}.emedia .strip img{max-width:48px}
.emedia .strip{flex-wrap:wrap}.emedia .placeholder{width:200px}.badge{white-space:nowrap}
.emedia .item .uri{font-size:11px}
svg text{font:11px system-ui,sans-serif;fill:#4b5563}
.headline{font-size:16px;margin:2px 0 6px}.headline b{font-size:18px}details.fp summary{cursor:pointer;color:#c7ccd6}
table.attempts{border-collapse:collapse;font-size:13px;margin-bottom:10px}table.attempts td,table.attempts th{
padding:2px 10px;text-align:right}table.attempts td.w,table.attempts th.w{text-align:left}
table.attempts tr.total td{border-top:1px solid #d1d5db;font-weight:600}
.timeline{display:flex;gap:8px;overflow-x:auto;padding-top:8px}.timeline figure.clip{margin:0;flex:none;width:150px;
font-size:12px}.timeline img{max-width:150px;border-radius:4px}.timeline .a{font-size:12px}
#clips .panel{margin-bottom:12px}
"""

CARD_CSS = """
.answer{margin-top:6px}.answer .q b.name{color:#1d2330;font-weight:600;margin-right:4px}.answer .tok{font-size:11px}
table.parsed{border-collapse:collapse;font-size:13px;margin-top:3px}table.parsed th,table.parsed td{padding:1px 8px;
border:1px solid #e5e7eb;text-align:left;vertical-align:top}table.parsed th{background:#f4f5f7;font-weight:600}
table.parsed td{word-break:break-word}
"""

SCRIPT = """addEventListener('load',()=>{const im=[...document.querySelectorAll('img.thumb')];
document.body.dataset.thumbsLoaded=im.filter(i=>i.complete&&i.naturalWidth>0).length;
document.body.dataset.thumbs=im.length;});"""

e = html.escape


def preview_media(rep: RunReport, max_thumbs: int) -> tuple[dict[str, str | None], set[str]]:
    """({uri: media_type} to preview, {uris never read}) of the sampled rows and the error examples,
    at most `max_thumbs` previewed. A media whose every row here is an `InputError` was refused by the
    run before reading (a remote manifest's local file, a link out of a glob's root, over a size
    limit): this machine does not read it either."""
    media = list(rep.sample) + [m for ms in rep.error_media.values() for m in ms]
    read_by_run = {r.get("media_uri") for r in media if r.get("error_type") != "InputError"}
    seen: dict[str, str | None] = {}
    refused: set[str] = set()
    for r in media:
        uri = r.get("media_uri")
        if not uri or uri in seen or uri in refused:
            continue
        if uri not in read_by_run:
            refused.add(uri)
        elif len(seen) < max_thumbs:
            seen[uri] = r.get("media_type")
    return seen, refused


def write_html(rep: RunReport, path: str | Path, opts: ThumbOptions | None = None, *, max_thumbs: int = 200) -> Path:
    """Thumbnails of the sampled rows' and the error examples' media (at most `max_thumbs`), then the page."""
    # a preview gives up sooner than a run: 2 attempts, 10 s to connect
    storage = replace(rep.ref.storage, max_attempts=min(2, rep.ref.storage.max_attempts),
                      connect_timeout_s=min(10.0, rep.ref.storage.connect_timeout_s))
    opts = opts or ThumbOptions(storage=storage, sampling=rep.ref.sampling, media_column=rep.ref.media_column)
    seen, refused = preview_media(rep, max_thumbs)
    thumbs = thumbnails(seen.items(), opts)
    thumbs.update({u: Thumb(note="InputError: refused by the run before reading, not read here either")
                   for u in refused})
    out = Path(path)
    out.write_text(render(rep, thumbs, timeline_frames(rep.timelines, opts)), encoding="utf-8")
    return out


def timeline_frames(timelines, opts: ThumbOptions) -> dict[str, list | Thumb]:
    """{video uri: one `Frame` per shown clip (`thumbnails.clip_frames`), or a placeholder `Thumb`}."""
    from vlbatch.jobs.inspect.thumbnails import clip_frames, fetch_all, placeholder

    data = fetch_all([v.uri for v in timelines], opts)
    out: dict[str, list | Thumb] = {}
    for v in timelines:
        got = data[v.uri]
        if isinstance(got, Thumb):
            out[v.uri] = got
            continue
        mids = [((c.start_s or 0.0) + (c.end_s if c.end_s is not None else c.start_s or 0.0)) / 2 for c in v.clips]
        try:
            out[v.uri] = clip_frames(got, mids, opts)
        except Exception as err:  # noqa: BLE001 - a preview: any failure is this video's placeholder
            out[v.uri] = placeholder(err)
    return out


def _timelines(timelines, frames: dict) -> str:
    """Each video's clips as a strip: a frame near the clip's middle, its start-end, source and caption."""
    from vlbatch.jobs.inspect.clips import span

    if not timelines:
        return ""
    blocks = []
    for v in timelines:
        got = frames.get(v.uri)
        cells = []
        for k, c in enumerate(v.clips):
            note = "not previewed" if got is None or isinstance(got, list) else (got.note or "")
            pic = _img(got[k]) if isinstance(got, list) else f'<div class="placeholder">{e(note)}</div>'
            cls = "a" if c.status == "ok" else "err"
            cells.append(f'<figure class="clip">{pic}<figcaption><b>#{c.index}</b> {e(span(c))} '
                         f'<span class="muted">{e(c.source or "")}</span><div class="{cls}">{e(c.text)}</div>'
                         '</figcaption></figure>')
        state = "complete" if v.complete else "last clip not committed"
        blocks.append(f'<div class="panel"><div class="uri">{e(v.uri)}</div><div class="meta">{v.count_text()} '
                      f'({state}), {v.visual_tokens} visual tokens</div>'
                      f'<div class="timeline">{"".join(cells)}</div></div>')
    return f'<h2>Clips</h2><section id="clips">{"".join(blocks)}</section>'


def render(rep: RunReport, thumbs: dict[str, Thumb], frames: dict | None = None) -> str:
    run_id = ", ".join(k for k, _ in rep.run_ids.most_common(2)) or rep.ref.uri.rsplit("/", 1)[-1]
    chips = "".join(f'<span class="{s if s in ("ok", "error") else "other"}">{n} {e(s)}</span>'
                    for s, n in sorted(rep.status.items(), key=lambda x: (x[0] != "ok", x[0])))
    fp = fingerprint_lines(rep)
    folded = (f'<details class="fp"><summary>fingerprint ({len(fp)} field{"s" if len(fp) != 1 else ""}: what the '
              f'answers were made with)</summary>{"<br>".join(e(x) for x in fp)}</details>')
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>vlbatch run {e(run_id)}</title>'
            f'<style>{CSS}{CARD_CSS}</style><script>{SCRIPT}</script></head><body>'
            f'<header><h1>vlbatch run {e(run_id)}</h1>{_headline(rep)}<div class="where">{e(rep.ref.uri)} · '
            f'{rep.rows} rows in {rep.parts} Parquet files</div>{folded}</header><main>'
            f'<div class="chips">{chips}</div>'
            f'<h2>Throughput</h2><div class="panel">{_throughput(rep.summary)}</div>'
            f'<h2>Tokens per request</h2><div class="row">{_histograms(rep)}</div>'
            f'{_timelines(rep.timelines, frames or {})}'
            f'{_sample(rep, thumbs)}{_quality(rep)}{_errors(rep, thumbs)}</main></body></html>\n')


def _headline(rep: RunReport) -> str:
    """The run in one line: rows, ok / error (and any other status), attempts, rows/s over the whole
    run, model, when it last finished."""
    attempts = run_attempts(rep.summary)
    total = whole_run(attempts)
    counts = {"ok": rep.status.get("ok", 0), "error": rep.status.get("error", 0), **rep.status}
    bits = [f"<b>{rep.rows} rows</b>", *(f"{n} {e(s)}" for s, n in counts.items())]
    if attempts:
        bits += [f"{len(attempts)} attempt{'s' if len(attempts) != 1 else ''}", f"{total.rows_per_s:.2f} rows/s"]
    bits.append("model " + (e(", ".join(k for k, _ in rep.models.most_common(2))) or "-"))
    if total.finished is not None:
        bits.append(f"finished {when(total.finished, seconds=False)} UTC")
    return f'<div class="headline">{" · ".join(bits)}</div>'


def _attempts(attempts: list[Attempt]) -> str:
    """The run attempt by attempt (each call of `vlbatch run`), then the whole run, as a table."""
    left = ' class="w"'  # the first two columns: text, left-aligned
    head = "".join(f"<th{left if k < 2 else ''}>{h}</th>" for k, h in enumerate(
        ("#", "started (UTC)", "rows", "ok", "error", "skipped", "seconds", "rows/s")))

    def row(a: Attempt, cls: str, first: str, started: str, skipped: str) -> str:
        cells = (first, started, a.rows, a.ok, a.error, skipped, f"{a.seconds:.1f}", f"{a.rows_per_s:.2f}")
        return (f'<tr class="{cls}">' + "".join(f"<td{left if k < 2 else ''}>{c}</td>" for k, c in enumerate(cells))
                + "</tr>")

    rows = [row(a, "attempt", str(a.number) + ("" if a.ended in (None, "finished") else f" ({a.ended})"),
                when(a.started), str(a.skipped)) for a in attempts]
    rows.append(row(whole_run(attempts), "total", "", "whole run", ""))
    return f'<table class="attempts"><tr>{head}</tr>{"".join(rows)}</table>'


def _img(frame, cls: str = "thumb") -> str:
    src = "data:image/jpeg;base64," + base64.b64encode(frame.jpeg).decode()
    return f'<img class="{cls}" src="{src}" width="{frame.width}" height="{frame.height}" alt="">'


def _media(uri: str | None, thumbs: dict[str, Thumb]) -> tuple[str, bool]:
    """(the media's HTML, is a strip)."""
    t = thumbs.get(uri or "")
    if t is None or not t.frames:
        why = "no media_uri" if not uri else (t.note if t is not None else "not previewed (thumbnail limit)")
        return f'<div class="placeholder" title="{e(why or "")}">{e((why or "")[:140])}</div>', False
    if len(t.frames) == 1 and t.frames[0].label is None:
        return _img(t.frames[0]), False
    figs = "".join(f"<figure>{_img(f)}<figcaption>{e(f.label or '')}</figcaption></figure>" for f in t.frames)
    return f'<div class="strip" title="{e(t.note or "")}">{figs}</div>', True


def _sample(rep: RunReport, thumbs: dict[str, Thumb]) -> str:
    """The sampled media, a card each (`cards`): its thumbnail or strip beside its prompts."""
    from vlbatch.jobs.inspect.cards import cards

    cond = " and ".join(f"{c}={v}" for c, v in rep.where)
    sampled = cards(rep.sample)
    head = (f'<h2>Sample <span class="muted">{len(sampled)} media ({len(rep.sample)} rows) of {rep.matched} rows'
            f'{" where " + e(cond) if cond else ""}, seed {rep.seed}</span></h2>')
    out = []
    for card in sampled:
        media, strip = _media(card.media_uri, thumbs)
        out.append(
            f'<div class="card{" video" if strip else ""}"><div class="media">{media}</div><div class="text">'
            f'<div class="uri">{e(card.media_uri or "(no media_uri)")}<span class="badge '
            f'{"ok" if card.ok else "error"}">{e(card.status_text())}</span></div>'
            f'{"".join(_answer(a) for a in card.answers)}'
            f'<div class="meta">{e(card.media_type or "")}</div></div></div>')
    return f'{head}<section id="sample" class="grid">{"".join(out)}</section>'


def _answer(a) -> str:
    """One prompt of a card (`cards.Answer`): its name and prompt, then its answer, its parsed value as
    a small table, or its error; every string escaped (answers are untrusted text)."""
    r = a.row
    if not a.ok:
        body = f'<div class="err">{e(r.get("error_type") or "")}: {e(r.get("error_message") or "")}</div>'
    elif a.items is None:
        body = f'<div class="a">{e(r.get("answer") or "")}</div>'
    else:
        body = ('<table class="parsed">' + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in a.items)
                + "</table>")
    toks = " · ".join(f"{k} {r.get(f'{k}_tokens')}" for k in TOKENS if r.get(f"{k}_tokens") is not None)
    return (f'<div class="answer {"ok" if a.ok else "error"}"><div class="q"><b class="name">{e(a.label)}</b> '
            f'{e(r.get("prompt") or "")}<span class="tok">{" · " + toks if toks else ""}</span></div>{body}</div>')


def _errors(rep: RunReport, thumbs: dict[str, Thumb]) -> str:
    if not rep.errors:
        return '<h2>Errors</h2><p class="muted">no error rows</p>'
    blocks = []
    for et, n in sorted(rep.errors.items(), key=lambda x: (-x[1], x[0])):
        items = "".join(f'<div class="item">{_media(m["media_uri"], thumbs)[0]}<div class="uri">'
                        f'{e(m["media_uri"] or "(no media_uri)")}</div></div>' for m in rep.error_media.get(et, []))
        count = f'{n} row{"s" if n != 1 else ""}'
        blocks.append(f'<div class="etype panel"><h3>{e(et)} <span class="muted">{count}</span></h3>'
                      f'<div class="err">e.g. {e(rep.examples.get(et) or "")}</div>'
                      f'<div class="emedia">{items}</div></div>')
    return f'<h2>Errors by type</h2><section id="errors">{"".join(blocks)}</section>'


def _quality(rep: RunReport) -> str:
    """Ok answers per quality flag (operators/quality.py), each with its first examples."""
    if not rep.quality:
        return ""
    ok = max(rep.status.get("ok", 0), 1)
    blocks = []
    for flag, n in sorted(rep.quality.items(), key=lambda x: (-x[1], x[0])):
        ex = "".join(f'<div class="item"><div class="uri">{e(r.get("media_uri") or "")}</div>'
                     f'<div class="a">{e(r.get("answer") or "")}</div></div>' for r in rep.quality_rows.get(flag, []))
        blocks.append(f'<div class="etype panel"><h3>{e(flag)} <span class="muted">{n} answers, {n / ok:.1%}'
                      f'</span></h3><div class="emedia">{ex}</div></div>')
    return f'<h2>Answer quality flags</h2><section id="quality">{"".join(blocks)}</section>'


def _histograms(rep: RunReport) -> str:
    out = []
    for name in TOKENS:
        h = rep.hist[name]
        top = max(h.values(), default=1)
        rows = "".join(f'<tr><td class="k">{e(k)}</td>'
                       f'<td><div class="b" style="width:{100 * h[k] / top:.0f}%"></div></td>'
                       f'<td class="n">{h[k]}</td></tr>' for k in sorted(h, key=hist_key))
        out.append(f'<div class="hist panel"><b>{name}</b><table>{rows or "<tr><td>none recorded</td></tr>"}'
                   f'</table></div>')
    return "".join(out)


def _throughput(summary: dict | None) -> str:
    """The attempts' table, then rows/s and tokens/s over time, every attempt one after another."""
    attempts = run_attempts(summary)
    table = _attempts(attempts) if attempts else '<p class="muted">no _summary.json: no call has finished</p>'
    series = rates(summary)
    if not series:
        return table + '<p class="muted">no throughput timeline recorded for this run</p>'
    s = summary or {}
    first = s.get("time_to_first_row_s")
    last = f"attempt {attempts[-1].number}, the last" if s.get("attempts") else "the last call"
    line = (table + f'<p>{last}: {s.get("rows_per_s", 0):.2f} rows/s, {s.get("generated_tokens_per_s", 0):.1f} '
            f'generated tok/s, {s.get("visual_tokens_per_s", 0):.0f} visual tok/s over {s.get("elapsed_s", 0):.1f} s'
            f'{"" if first is None else f"; first row after {first:.1f} s"}</p>')
    width = 2 * series[0][0]  # bucket width, s
    return (line + '<div class="plots">'
            + _plot("rows/s", width, [("rows/s", [p[1] for p in series], "#2f6fd6")])
            + _plot("tokens/s", width, [("generated tok/s", [p[2] for p in series], "#d6492f"),
                                        ("visual tok/s", [p[3] for p in series], "#2f9d6a")]) + "</div>")


def _nice(top: float, steps=(1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10)) -> float:
    """The smallest m x 10^k (m in `steps`) at or above `top`: an axis maximum or tick step."""
    k = 10 ** math.floor(math.log10(top)) if top > 0 else 1.0
    return next(m * k for m in steps if m * k >= top * (1 - 1e-9))


def _plot(title: str, width_s: float, series: list[tuple[str, list[float], str]], w: int = 580, h: int = 180) -> str:
    """One inline SVG bar chart: each series' value per time bucket (`width_s` seconds each), side by side."""
    left, right, top, bottom = 52, 18, 24, 26
    n = len(series[0][1])
    x1, y1 = n * width_s, _nice(max(max(v) for _, v, _ in series) or 1.0)
    xstep = _nice(x1 / 6, (1, 2, 5, 10))
    sx = lambda x: left + (w - left - right) * x / x1  # noqa: E731
    sy = lambda y: h - bottom - (h - top - bottom) * y / y1  # noqa: E731
    grid = "".join(f'<line x1="{left}" x2="{w - right}" y1="{sy(y1 * k / 4):.1f}" y2="{sy(y1 * k / 4):.1f}" '
                   f'stroke="#e5e7eb"/><text x="{left - 6}" y="{sy(y1 * k / 4) + 4:.1f}" text-anchor="end">'
                   f'{y1 * k / 4:g}</text>' for k in range(5))
    xt = "".join(f'<text x="{sx(k * xstep):.1f}" y="{h - 8}" text-anchor="middle">{k * xstep:g} s</text>'
                 for k in range(int(x1 / xstep + 1e-9) + 1))
    bars, legend = [], []
    bw = (sx(width_s) - sx(0)) / len(series)
    for j, (name, vals, color) in enumerate(series):
        bars += [f'<rect x="{sx(i * width_s) + j * bw:.2f}" y="{sy(v):.1f}" width="{max(bw * 0.9, 0.8):.2f}" '
                 f'height="{sy(0) - sy(v):.1f}" fill="{color}"><title>{i * width_s:g}-{(i + 1) * width_s:g} s: '
                 f'{v:.3g} {e(name)}</title></rect>' for i, v in enumerate(vals) if v > 0]
        legend.append(f'<text x="{left + 4 + 150 * j}" y="14" style="fill:{color}">■ {e(name)}</text>')
    axis = f'<line x1="{left}" x2="{w - right}" y1="{sy(0):.1f}" y2="{sy(0):.1f}" stroke="#9ca3af"/>'
    return (f'<svg class="plot" role="img" aria-label="{e(title)} over time" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}">{grid}{"".join(bars)}{axis}{xt}{"".join(legend)}</svg>')
