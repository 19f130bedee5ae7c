"""The demo's printout: each media's (or clip's) caption and structured answer next to the scene generator's
record, the structured question's match rate, and the reel's scene cuts found vs the true ones.

Pure functions of the committed rows and the record `pipeline/demo.py` writes (`media/scenes.json`), so
the scoring is tested without a run (`tests/test_demo_report.py`). Imports nothing from devtools.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ["media_uri", "status", "error_type", "answer", "prompt_name", "parsed", "clip_index", "clip_start_s",
           "clip_end_s"]
QUESTION = "shapes"  # configs/demo.yaml's structured question
CAPTION = "caption"


@dataclass(frozen=True)
class Match:
    """The structured question over the media (and clips) with a record: `asked` of them, `shapes` with the
    exact kinds (as a multiset), `count` with the right count, `failed` whose answer row is an error."""

    asked: int = 0
    shapes: int = 0
    count: int = 0
    failed: int = 0

    def text(self) -> str:
        tail = f" ({self.failed} error rows)" if self.failed else ""
        return f"shapes: {self.shapes}/{self.asked} exact, count: {self.count}/{self.asked}{tail}"


@dataclass(frozen=True)
class Cuts:
    """A reel's cuts: `found` (clip starts after 0), `true` cuts, `hit` true cuts with a found one within
    `tolerance_s`, `extra` found cuts near no true one."""

    found: int
    true: int
    hit: int
    extra: int
    tolerance_s: float

    def text(self) -> str:
        return (f"{self.found} cuts found, {self.true} true: {self.hit}/{self.true} within {self.tolerance_s:.3f} s "
                f"(one frame) of a true cut, {self.extra} extra")


def scene_at(record: dict, start: float | None, end: float | None) -> dict | None:
    """The record of a media, or for a reel the scene overlapping the clip [start, end] the most."""
    scenes = record.get("scenes")
    if scenes is None:
        return record
    if start is None or end is None:
        return None
    overlap = [min(end, s["end_s"]) - max(start, s["start_s"]) for s in scenes]
    best = max(range(len(scenes)), key=overlap.__getitem__)
    return scenes[best] if overlap[best] > 0 else None


def judge(parsed: str | None, shapes: list[str]) -> tuple[bool, bool]:
    """(kinds exact as a multiset, count right) of a structured answer `{"shapes": [...], "count": n}`."""
    try:
        value = json.loads(parsed) if parsed is not None else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return False, False
    got = value.get("shapes")
    exact = isinstance(got, list) and sorted(map(str, got)) == sorted(shapes)
    return exact, value.get("count") == len(shapes)


def score(groups: dict, truth: dict) -> Match:
    """The structured question's match rate over `groups` ({(uri, clip): {prompt_name: row}})."""
    asked = shapes = count = failed = 0
    for (uri, _), rows in groups.items():
        row = rows.get(QUESTION)
        first = next(iter(rows.values()))
        scene = scene_at(truth[uri], first["clip_start_s"], first["clip_end_s"]) if uri in truth else None
        if row is None or scene is None:
            continue
        asked += 1
        if row["status"] != "ok":
            failed += 1
            continue
        exact, right = judge(row["parsed"], scene["shapes"])
        shapes, count = shapes + exact, count + right
    return Match(asked, shapes, count, failed)


def cuts(starts: list[float], true_cuts: list[float], tolerance_s: float) -> Cuts:
    """`starts`: a reel's clip starts (s); a true cut is hit by the nearest unused start within tolerance."""
    found = sorted(s for s in starts if s > tolerance_s)
    left, hit = list(found), 0
    for cut in true_cuts:
        near = [s for s in left if abs(s - cut) <= tolerance_s + 1e-9]
        if near:
            left.remove(min(near, key=lambda s: abs(s - cut)))
            hit += 1
    return Cuts(len(found), len(true_cuts), hit, len(left), tolerance_s)


def read_rows(output_root: Path) -> tuple[list[dict], int]:
    """Every committed row (COLUMNS) under `output_root`, and the number of Parquet files."""
    import pyarrow.dataset as ds

    parts = sorted(output_root.rglob("part-*.parquet"))
    if not parts:
        return [], 0
    table = ds.dataset([str(p) for p in parts], format="parquet").to_table(columns=COLUMNS)
    rows = table.to_pylist()
    for r in rows:  # Arrow's JSON extension type reads back as text or as its storage's value
        r["parsed"] = None if r["parsed"] is None else str(r["parsed"])
    return rows, len(parts)


def grouped(rows: list[dict]) -> dict:
    """{(media_uri, clip_index): {prompt_name: row}}, ok media first, then by name and clip."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: (r["status"] != "ok", r["media_uri"], r["clip_index"] or 0)):
        out.setdefault((r["media_uri"], r["clip_index"]), {})[r["prompt_name"] or CAPTION] = r
    return out


def print_report(output_root: Path, show: int, truth: dict, out) -> None:
    """The printout (module docstring) of the run under `output_root` to `out`."""
    rows, n_parts = read_rows(output_root)
    if not rows:
        print(f"no output under {output_root}", file=out)
        return
    ok = sum(r["status"] == "ok" for r in rows)
    print(f"{len(rows)} rows in {n_parts} Parquet files under {output_root}: {ok} ok, {len(rows) - ok} error",
          file=out)
    groups = grouped(rows)
    for key in list(groups)[:show]:
        _print_group(key, groups[key], truth, out)
    print(f"[demo] structured question {QUESTION!r} (JSON schema: the shapes as an enum list, their count as an "
          f"integer; the model was trained on captions only): {score(groups, truth).text()}", file=out)
    for uri, record in truth.items():
        if "scenes" in record:
            starts = [next(iter(g.values()))["clip_start_s"] for (u, clip), g in groups.items()
                      if u == uri and clip is not None]
            res = cuts(starts, [s["start_s"] for s in record["scenes"][1:]], 1.0 / record["fps"])
            print(f"[demo] scene cuts in {Path(uri).name}: {res.text()}", file=out)


def _print_group(key, rows: dict, truth: dict, out) -> None:
    uri, clip = key
    first = next(iter(rows.values()))
    name = Path(uri).name
    if clip is not None and (uri in truth and "scenes" in truth[uri]):
        name += f" clip {clip} {first['clip_start_s']:.2f}-{first['clip_end_s']:.2f} s"
    if all(r["status"] != "ok" for r in rows.values()):
        print(f"  {name:<28} error {first['error_type']}", file=out)
        return
    scene = scene_at(truth[uri], first["clip_start_s"], first["clip_end_s"]) if uri in truth else None
    cap, q = rows.get(CAPTION), rows.get(QUESTION)
    if cap is not None:
        print(f"  {name:<28} model: {cap['answer'] if cap['status'] == 'ok' else 'error ' + cap['error_type']}",
              file=out)
    if scene is not None:
        where = f" (scene {scene['start_s']:.2f}-{scene['end_s']:.2f} s)" if "start_s" in scene else ""
        print(f"  {'':<28} truth{where}: {scene['caption']}", file=out)
    if q is not None:
        got = q["parsed"] if q["status"] == "ok" else f"error {q['error_type']}"
        want = "" if scene is None else "   truth: " + json.dumps({"count": len(scene["shapes"]),
                                                                  "shapes": scene["shapes"]}, separators=(",", ":"))
        print(f"  {'':<28} {QUESTION}: {got}{want}", file=out)
