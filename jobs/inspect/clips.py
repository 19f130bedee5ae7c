"""A clipped run's videos as timelines, for `vlbatch inspect` (`video.clips`, issue 51).

`Timelines` is fed each part as `read_run` streams it (the clip columns only, `CLIP_COLUMNS`) and keeps
the clip rows of the first `videos` video URIs in sort order: per clip, its row of the lowest request
index (a clip's prompts share its times; that row's answer is the clip's caption), at most
`MAX_CLIPS` clips a video. `finish(sink)` reads those rows in full (each part holding one read once) and
gives `VideoTimeline`s: each clip's index, start-end (seconds in the source), source (scenes | fixed),
caption or error, visual tokens; the video's clip count, whether its last clip is committed (`clip_last`),
its visual tokens in all. `print_timelines` is the terminal form (one line per clip, the first
`shown` clips of a video); `html` draws each as a strip of frames (`thumbnails.clip_frames`).
Memory: `videos` x `MAX_CLIPS` small tuples, whatever the run's size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CLIP_COLUMNS = ["request_index", "clip_index", "clip_start_s", "clip_end_s", "clip_source", "clip_last"]
TIMELINE_VIDEOS = 3  # videos shown
MAX_CLIPS = 10_000  # clips kept per video (a 2-hour video in 1 s windows)
SHOWN_CLIPS = 60  # clips printed / drawn per video


@dataclass(frozen=True)
class ClipLine:
    index: int
    start_s: float | None
    end_s: float | None
    source: str | None
    status: str
    text: str  # the caption (the answer of the clip's first prompt), or "ErrorType: message"
    visual_tokens: int | None


@dataclass(frozen=True)
class VideoTimeline:
    uri: str
    clips: tuple[ClipLine, ...]  # the first `SHOWN_CLIPS` by index
    count: int  # the video's clips committed
    complete: bool  # its last clip is committed (a row says clip_last)
    visual_tokens: int  # over all its clips (each clip once)

    def count_text(self) -> str:
        """'1 clip' / '3 clips'."""
        return f"{self.count} clip{'' if self.count == 1 else 's'}"


class Timelines:
    """The streamed state (module docstring): {uri: {clip index: (request index, visual, last, part, row)}}."""

    def __init__(self, videos: int = TIMELINE_VIDEOS):
        self.videos = videos
        self.kept: dict[str, dict[int, tuple]] = {}

    def add(self, t: pa.Table, part: str) -> None:
        """One part's rows (`media_uri`, `visual_tokens` and `CLIP_COLUMNS`; a part without them: none)."""
        if "clip_index" not in t.column_names or not self.videos:
            return
        rows = np.flatnonzero(pc.is_valid(t["clip_index"]).to_numpy(zero_copy_only=False))
        if not len(rows):
            return
        sub = t.take(pa.array(rows))
        last = sub["clip_last"].to_pylist() if "clip_last" in sub.column_names else [None] * len(rows)
        cols = zip(sub["media_uri"].to_pylist(), sub["clip_index"].to_pylist(), sub["request_index"].to_pylist(),
                   sub["visual_tokens"].to_pylist(), last, rows.tolist(), strict=True)
        for uri, k, ri, vis, end, row in cols:
            if uri is None or not self._room(uri):
                continue
            clips = self.kept.setdefault(uri, {})
            have = clips.get(k)
            if (have is None and len(clips) < MAX_CLIPS) or (have is not None and ri < have[0]):
                clips[k] = (ri, vis, bool(end) or (have is not None and have[2]), part, row)
            elif have is not None and end:
                clips[k] = (*have[:2], True, *have[3:])
            if len(self.kept) > self.videos:
                del self.kept[max(self.kept)]

    def _room(self, uri: str) -> bool:
        return uri in self.kept or len(self.kept) < self.videos or uri < max(self.kept)

    def finish(self, sink) -> list[VideoTimeline]:
        """The kept videos, by URI, their first `SHOWN_CLIPS` clips read in full."""
        want: dict[str, list[tuple[int, str]]] = {}  # part -> [(row, key)]
        for uri, clips in self.kept.items():
            for k in sorted(clips)[:SHOWN_CLIPS]:
                want.setdefault(clips[k][3], []).append((clips[k][4], f"{uri}\x00{k}"))
        full: dict[str, dict] = {}
        for part, at in want.items():
            got = sink.read_part(part).take(pa.array([r for r, _ in at])).to_pylist()
            full.update({key: row for (_, key), row in zip(at, got, strict=True)})
        out = []
        for uri in sorted(self.kept):
            clips = self.kept[uri]
            lines = tuple(_line(full[f"{uri}\x00{k}"]) for k in sorted(clips)[:SHOWN_CLIPS])
            out.append(VideoTimeline(uri, lines, len(clips), any(c[2] for c in clips.values()),
                                     sum(c[1] or 0 for c in clips.values())))
        return out


def _line(r: dict) -> ClipLine:
    ok = r.get("status") == "ok"
    text = (r.get("answer") or "") if ok else f"{r.get('error_type')}: {r.get('error_message') or ''}"
    return ClipLine(int(r["clip_index"]), r.get("clip_start_s"), r.get("clip_end_s"), r.get("clip_source"),
                    r.get("status") or "", text, r.get("visual_tokens"))


def span(c: ClipLine) -> str:
    """'2.30-5.70 s' (seconds in the source; '?' where a row lacks one)."""
    f = lambda v: "?" if v is None else f"{v:.2f}"  # noqa: E731
    return f"{f(c.start_s)}-{f(c.end_s)} s"


def print_timelines(timelines: list[VideoTimeline], w, one_line) -> None:
    """The terminal form: per video a head line, then one line per clip: index, start-end, source, caption."""
    if not timelines:
        return
    w(f"\nclips: the first {len(timelines)} video{'s' if len(timelines) != 1 else ''} with clip rows, by URI "
      "(a clip's caption: its first prompt's answer)\n")
    for v in timelines:
        more = f", the first {len(v.clips)} shown" if len(v.clips) < v.count else ""
        state = "complete" if v.complete else "last clip not committed"
        w(f"  {v.uri}: {v.count_text()} ({state}{more}), {v.visual_tokens} visual tokens\n")
        for c in v.clips:
            w(f"    {c.index:>4}  {span(c):>17}  {c.source or '-':<6}  {one_line(c.text, 100)}\n")
