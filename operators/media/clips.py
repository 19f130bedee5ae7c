"""Clip boundaries of a video: fixed windows and scene cuts (`video.clips`), Ray-free.

Owns where clips start and end, in the source's frame index space (frames that really decode,
counted as they decode, never the header's duration):

- fixed: windows of `window_s` starting every `stride_s` (default `window_s`); the first window
  reaching the last frame ends the list; a last window shorter than `min_clip_s` is dropped; a video
  of at most `min_clip_s` is one whole-video clip (never zero clips).
- scenes: shots between the cuts PySceneDetect's detector (content | adaptive) finds on small
  frames; a shot longer than `window_s` is split into windows of `window_s`; a piece shorter than
  `min_clip_s` merges into its neighbour (the previous one, or the next for the first), never past
  `2 * window_s`.

Both are *planners* fed frame by frame (`advance(i)` after frame i decoded, `cut(c)`, `finish(n)`)
that hand back finished clips as soon as their last frame has decoded, so the decode
(`clip_decode.py`) keeps only the frames from `keep_from` on: memory is bounded by a few windows,
not by the video. `fixed_clips` / `scene_clips` are the same rules over a whole count (tests, scan).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import InputError

DETECT_WIDTH = 128  # the detector's frames are this wide (height by aspect, even): cheap, enough for cuts


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


class ScenePlanner:
    """Shots between cuts, split at `window_s`, short pieces merged (module docstring)."""

    def __init__(self, rule: ClipRule, fps: float):
        self.fps = fps
        self.window, _, self.min = rule.frames(fps)
        self.open = 0  # first frame of the open shot
        self.pending: tuple[int, int] | None = None  # a finished piece held back: the next may merge into it
        self.emitted = 0

    def cut(self, c: int) -> list[Clip]:
        """The detector found a cut before frame `c` (a cut inside a piece already closed is ignored)."""
        if c <= self.open:
            return []
        piece, self.open = (self.open, c), c
        return self._piece(piece)

    def advance(self, i: int) -> list[Clip]:
        if i + 1 - self.open >= self.window:  # the open shot is one window long: close it here
            piece, self.open = (self.open, i + 1), i + 1
            return self._piece(piece)
        return []

    def _piece(self, piece: tuple[int, int]) -> list[Clip]:
        held = self.pending
        if held is None:
            self.pending = piece
            return []
        short = (piece[1] - piece[0]) < self.min or (held[1] - held[0]) < self.min
        if short and piece[1] - held[0] <= 2 * self.window:
            self.pending = (held[0], piece[1])
            return []
        self.pending = piece
        return [self._clip(held)]

    def _clip(self, piece: tuple[int, int]) -> Clip:
        self.emitted += 1
        return Clip(self.emitted - 1, piece[0], piece[1], self.fps, "scenes")

    def finish(self, total: int) -> list[Clip]:
        out = self._piece((self.open, total)) if total > self.open else []
        if self.pending is not None:
            out.append(self._clip(self.pending))
            self.pending = None
        self.open = total
        return out

    @property
    def keep_from(self) -> int:
        return self.open if self.pending is None else self.pending[0]


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
