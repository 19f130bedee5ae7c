"""Clip boundaries of a video: fixed windows and scene cuts (`video.clips`), Ray-free.

Owns where clips start and end, in the source's frame index space (frames that really decode,
counted as they decode, never the header's duration):

- fixed: windows of `window_s` starting every `stride_s` (default `window_s`); the first window
  reaching the last frame ends the list; a last window shorter than `min_clip_s` is dropped; a video
  of at most `min_clip_s` is one whole-video clip (never zero clips).
- scenes: shots between the cuts PySceneDetect's detector (content | adaptive) finds on frames
  `DETECT_WIDTH` wide (`clip_decode.small_bgr`). Consecutive shots shorter than `min_clip_s` form a run:
  a run of at least `min_clip_s` is a segment of its own, a shorter one joins the segment before it (the
  next for the video's first), so a cut between two shots of at least `min_clip_s` always stays. Each
  segment is split into clips of `window_s` from its start; a last piece shorter than `min_clip_s` and the
  clip before share their frames evenly. No clip is longer than `window_s` (a `min_clip_s` above it
  counts as `window_s`).

Both are *planners* fed frame by frame (`advance(i)` after frame i decoded, `cut(c)`, `finish(n)`)
that hand back finished clips as soon as their last frame has decoded, so the decode
(`clip_decode.py`) keeps only the frames from `keep_from` on: memory is bounded by a few windows
(scenes: the held clip, the open piece and the frames whose cut is still open, `2 * min_clip_s` at most),
not by the video. `fixed_clips` / `scene_clips` are the same rules over a whole count (tests, scan).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import InputError

# the detector's frames are this wide (height by aspect, even), area-averaged (`clip_decode.small_bgr`): on
# 640x360 and 1280x720 test videos (scrolling stripes, fine textures) its cuts are full size's where 128 missed
# cuts between fine textures and 256 found no more; the cost is the average over every source pixel (~0.3 ms a
# 720p frame), about the same at 128 (benchmarks/bench_clips.py)
DETECT_WIDTH = 192


@dataclass(frozen=True)
class ClipRule:
    """`video.clips` (pipeline/config/schema.py `ClipsSection`); seconds."""

    mode: str = "none"  # none | fixed | scenes
    window_s: float = 10.0
    stride_s: float | None = None
    min_clip_s: float = 1.0
    detector: str = "content"  # content | adaptive
    threshold: float | None = None
    allow_gaps: bool = False

    def frames(self, fps: float) -> tuple[int, int, int]:
        """(window, stride, min clip) in frames at `fps` (window and stride at least 1)."""
        if not (fps > 0 and self.window_s > 0):
            raise InputError(f"clips need a positive frame rate and window_s (fps={fps!r}, window_s={self.window_s!r})")
        stride_s = self.window_s if self.stride_s is None else self.stride_s
        return (max(1, round(self.window_s * fps)), max(1, round(stride_s * fps)), round(self.min_clip_s * fps))


@dataclass(frozen=True)
class Clip:
    """Frames [start, end) of the source (end exclusive); `source`: how it was cut (scenes | fixed)."""

    index: int
    start: int
    end: int
    fps: float
    source: str

    @property
    def frames(self) -> int:
        return self.end - self.start

    @property
    def start_s(self) -> float:
        return self.start / self.fps

    @property
    def end_s(self) -> float:
        return self.end / self.fps


class FixedPlanner:
    """Fixed windows from frame `origin` on (a scene decode whose detector failed falls back here)."""

    def __init__(self, rule: ClipRule, fps: float, origin: int = 0, first_index: int = 0):
        self.fps, self.origin, self.first_index = fps, origin, first_index
        self.window, self.stride, self.min = rule.frames(fps)
        self.emitted = 0  # windows handed out so far

    def _start(self, k: int) -> int:
        return self.origin + k * self.stride

    def advance(self, i: int) -> list[Clip]:
        """Frame `i` has decoded: the windows whose last frame it is (never before more than min_clip_s
        decoded: a shorter video is one whole clip, decided at `finish`)."""
        out = []
        n = i + 1 - self.origin
        while n > self.min and self._start(self.emitted) + self.window <= i + 1:
            s = self._start(self.emitted)
            out.append(Clip(self.first_index + self.emitted, s, s + self.window, self.fps, "fixed"))
            self.emitted += 1
        return out

    def finish(self, total: int) -> list[Clip]:
        """The stream ended after `total` frames: the windows not handed out yet."""
        rest = _fixed_bounds(total - self.origin, self.window, self.stride, self.min)[self.emitted:]
        return [Clip(self.first_index + self.emitted + k, self.origin + s, self.origin + e, self.fps, "fixed")
                for k, (s, e) in enumerate(rest)]

    @property
    def keep_from(self) -> int:
        """The first frame a clip not handed out yet can hold."""
        return self._start(self.emitted)


def _fixed_bounds(total: int, window: int, stride: int, min_frames: int) -> list[tuple[int, int]]:
    if total <= 0:
        return []
    if total <= min_frames:
        return [(0, total)]
    out, start = [], 0
    while start < total:
        end = min(start + window, total)
        if out and end - start < min_frames:
            break  # a last window shorter than min_clip_s
        out.append((start, end))
        if end == total:
            break
        start += stride
    return out


def fixed_clips(total: int, fps: float, rule: ClipRule) -> list[Clip]:
    """The fixed windows of a video of `total` frames at `fps`."""
    p = FixedPlanner(rule, fps)
    return p.finish(total)


class _Segments:
    """Detector cuts -> the kept cuts (segment starts) by the merge rule (module docstring), each
    decided at most `2 * min` frames after it: `cut(c)`, `advance(now)` and `finish(total)` return the
    kept cuts decided since, in order; `frontier`: every kept cut before it is decided."""

    def __init__(self, min_frames: int):
        self.min = min_frames
        self.shot = 0  # start of the open shot
        self.long = False  # the open shot is known long (>= min)
        self.run: int | None = None  # start of the run of short shots that ends at `shot`
        self.run_big = False  # that run is >= min: a segment of its own (its start kept)

    def cut(self, c: int) -> list[int]:
        if c <= self.shot:
            return []  # inside a shot already closed
        out = self.advance(c)  # a shot of at least min frames is long
        if not self.long:  # a short shot: it joins (or starts) the run
            self.run = self.shot if self.run is None else self.run
            if not self.run_big and c - self.run >= self.min:
                self.run_big = True
                out = [self.run] if self.run > 0 else []
        self.shot, self.long = c, False
        return out

    def advance(self, now: int) -> list[int]:
        if self.long or now - self.shot < self.min:
            return []
        self.long = True  # the open shot is long: the run before it (if any) has ended
        return self._run_ended()

    def _run_ended(self) -> list[int]:
        """The open shot is long: the cut at its start is kept, unless the run before it is the video's
        first and shorter than min (it joins this shot). A run shorter than min after a segment joins that
        segment (the cut at its start was never kept)."""
        run, big = self.run, self.run_big
        self.run, self.run_big = None, False
        if self.shot == 0 or (run == 0 and not big):
            return []
        return [self.shot]

    def finish(self, total: int) -> list[int]:
        """The stream ended after `total` frames: a last run shorter than min joins the segment before it."""
        return self.advance(total) if total - self.shot >= self.min else []

    @property
    def frontier(self) -> int | None:
        """The first frame whose kept-or-not is open (a cut at the open shot's start, or the open run's
        start); None when nothing is open (every cut up to the newest frame is decided)."""
        if self.run is not None and not self.run_big:
            return self.run
        if self.long or self.shot == 0:
            return None
        return self.shot


class ScenePlanner:
    """Shots between cuts, short pieces merged, every segment split into clips of at most `window_s`
    (module docstring). Holds one closed clip back: a segment's last piece shorter than min shares the
    frames of it and the held clip evenly."""

    def __init__(self, rule: ClipRule, fps: float):
        self.fps = fps
        self.window, _, m = rule.frames(fps)
        self.min = min(m, self.window)  # a clip is never longer than window_s, so never asked to be
        self.segments = _Segments(self.min)
        self.piece = 0  # start of the open piece of the open segment
        self.held: tuple[int, int] | None = None  # the last closed piece of the open segment
        self.emitted = 0

    def cut(self, c: int) -> list[Clip]:
        """The detector found a cut before frame `c`."""
        return self._kept(self.segments.cut(c))

    def advance(self, i: int) -> list[Clip]:
        """Frame `i` has decoded."""
        out = self._kept(self.segments.advance(i + 1))
        frontier = self.segments.frontier
        return out + self._windows(i + 1 if frontier is None else frontier)

    def finish(self, total: int) -> list[Clip]:
        out = self._kept(self.segments.finish(total))
        if total > self.piece:
            out += self._end(total)
        elif self.held is not None:
            out.append(self._clip(self.held))
            self.held = None
        return out

    def _kept(self, cuts: list[int]) -> list[Clip]:
        out: list[Clip] = []
        for c in cuts:
            if c > self.piece:  # a cut at or before the open piece: inside a clip already closed
                out += self._end(c)
        return out

    def _windows(self, upto: int) -> list[Clip]:
        """Close the open segment's full windows that end at or before `upto` (no kept cut before it is open)."""
        out: list[Clip] = []
        while self.piece + self.window <= upto:
            if self.held is not None:
                out.append(self._clip(self.held))
            self.held, self.piece = (self.piece, self.piece + self.window), self.piece + self.window
        return out

    def _end(self, c: int) -> list[Clip]:
        """The open segment ends before frame `c`: its pieces, the last two evened out when the last is short."""
        out = self._windows(c)
        held, tail = self.held, (self.piece, c)
        self.held, self.piece = None, c
        if held is not None and 0 < tail[1] - tail[0] < self.min:
            mid = (held[0] + c + 1) // 2
            return out + [self._clip((held[0], mid)), self._clip((mid, c))]
        pieces = ([held] if held is not None else []) + ([tail] if tail[1] > tail[0] else [])
        return out + [self._clip(p) for p in pieces]

    def _clip(self, piece: tuple[int, int]) -> Clip:
        self.emitted += 1
        return Clip(self.emitted - 1, piece[0], piece[1], self.fps, "scenes")

    @property
    def keep_from(self) -> int:
        return self.piece if self.held is None else self.held[0]


def scene_clips(cuts, total: int, fps: float, rule: ClipRule) -> list[Clip]:
    """The scene clips of a video of `total` frames with cuts before frames `cuts` (as the decode
    makes them frame by frame)."""
    p, out, todo = ScenePlanner(rule, fps), [], sorted(set(int(c) for c in cuts))
    for i in range(total):
        while todo and todo[0] <= i:
            out += p.cut(todo.pop(0))
        out += p.advance(i)
    return out + p.finish(total)


class CutDetector:
    """PySceneDetect's detector fed our own small BGR frames `[h, w, 3]` uint8 (it never opens the
    file): `feed(i, frame)` -> cut frame indices found so far; `finish(i)` the rest."""

    def __init__(self, rule: ClipRule, fps: float):
        from scenedetect import AdaptiveDetector, ContentDetector

        if rule.detector == "content":
            kw = {} if rule.threshold is None else {"threshold": rule.threshold}
            self.detector = ContentDetector(min_scene_len=1, **kw)
        elif rule.detector == "adaptive":
            kw = {} if rule.threshold is None else {"adaptive_threshold": rule.threshold}
            self.detector = AdaptiveDetector(min_scene_len=1, **kw)
        else:
            raise InputError(f"video.clips.detector {rule.detector!r} is unknown (content | adaptive)")
        self.fps = fps

    def feed(self, i: int, frame: np.ndarray) -> list[int]:
        from scenedetect.common import FrameTimecode

        return [int(t.frame_num) for t in self.detector.process_frame(FrameTimecode(i, self.fps), frame)]

    def finish(self, i: int) -> list[int]:
        from scenedetect.common import FrameTimecode

        return [int(t.frame_num) for t in self.detector.post_process(FrameTimecode(i, self.fps))]
