"""One decode of a video into its clips (`video.clips`: fixed windows or scene cuts), Ray-free.

`decode_clips(data, rule, sampling)` decodes every picture once, in presentation order (PyAV),
and yields `(Clip, VideoClip | VlbatchError)` per clip as soon as its last frame has decoded:

- scenes: each picture, area-averaged to `DETECT_WIDTH` wide BGR (`small_bgr`), feeds PySceneDetect's
  detector (`clips.CutDetector`); its cuts close shots in `clips.ScenePlanner`. A detector that
  fails (to start or on a frame) falls back to fixed windows from the first frame not yet in a
  clip; those clips say `source == "fixed"`.
- each clip is sampled by the reference's rule applied to a video of the clip's length
  (`sampling.sample_frame_indices(clip.frames, fps, ...)`), so the `VideoClip` holds indices
  relative to the clip and `total_frames = clip.frames`: the timestamps the model sees start at 0
  at the clip's start, as the reference processor gives them for a video of that length.

Memory: the decoded pictures (YUV, as the codec made them: 1.5 B per pixel for 4:2:0) from the
planner's `keep_from` on, so a few windows (scenes: one held clip and the open piece, each <= window_s,
plus the frames whose cut is still open, <= 2 min_clip_s; fixed: one window plus the overlap), plus one
clip's sampled RGB frames; never the whole video. Only sampled frames are converted to RGB.

Where it runs: in the killable decoder child (`worker.DecodeWorker.decode_clips`: the child serves
`stream_clips`, each clip's header and sampled frames go through the parent's frame ring as they are
converted, so the child never holds a clip's RGB frames as a whole; its time limit bounds the time
between two clips, and a hang or crash ends that video's clips there). In-process (tests, benchmarks)
`timeout_s` bounds the time between two clips too, checked between pictures (cooperative only).

Clip files (`output.clip_files`): `stream_clips`' `on_clip(clip, frames, stream)`, when given, is called once
per clip that samples (a clip that is its own error row gets no file) just before it is yielded, with an
iterator over the held pictures of frames [start, end) (PyAV frames of the input `stream`, in order) and
the video's display rotation as `rotation=`: the decoder child's `clip_files.write_clip` encodes them one
by one into the parent's local folder (no second decode).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from vlbatch.operators.errors import InputError, MediaError, MediaTimeoutError, VlbatchError
from vlbatch.operators.media.clips import DETECT_WIDTH, Clip, ClipRule, CutDetector, FixedPlanner, ScenePlanner
from vlbatch.operators.media.decoders import VideoData
from vlbatch.operators.media.sampling import sample_frame_indices
from vlbatch.operators.media.video import FrameSampling
from vlbatch.operators.types import VideoClip


def clip_indices(clip: Clip, sampling: FrameSampling) -> np.ndarray:
    """[F] int64 frame indices relative to the clip's start: the reference's sampling of a video of
    `clip.frames` frames at the source's rate."""
    idx = sample_frame_indices(clip.frames, clip.fps, fps=sampling.fps, num_frames=sampling.num_frames,
                               min_frames=sampling.min_frames, max_frames=sampling.max_frames)
    return np.clip(idx, 0, clip.frames - 1)


def _detect_size(width: int, height: int) -> tuple[int, int]:
    w = min(DETECT_WIDTH, width)
    return max(2, w - w % 2), max(2, round(height * w / width / 2) * 2)


def small_bgr(frame, reformatter) -> np.ndarray:
    """The detector's picture `[h, w, 3]` BGR uint8, `DETECT_WIDTH` wide (`_detect_size`), each pixel the
    average of the source pixels it covers (swscale's area filter). Never every n-th sample: fine texture
    in motion (scrolling stripes) then aliases into a different picture each frame, the detector's false
    cuts (issue 60: 34 on 5 s of stripes)."""
    size = _detect_size(frame.width, frame.height)
    return reformatter.reformat(frame, width=size[0], height=size[1], format="bgr24",
                                interpolation="AREA").to_ndarray()


class _Held:
    """The decoded pictures from `first` on: `[(index, av frame)]` in order."""

    def __init__(self):
        self.frames: deque = deque()

    def add(self, i: int, frame) -> None:
        self.frames.append((i, frame))

    def drop_before(self, i: int) -> None:
        while self.frames and self.frames[0][0] < i:
            self.frames.popleft()

    def get(self, i: int):
        first = self.frames[0][0]
        return self.frames[i - first][1]


@dataclass(frozen=True)
class SampledClip:
    """One clip's sampling, before its frames: `indices` `[F]` relative to the clip, frames `shape`
    `(F, H, W, 3)`; `frames()` yields its RGB frames `[H, W, 3]` uint8 one by one, valid only until
    the next clip is asked for (the decode drops the pictures behind it)."""

    indices: tuple[int, ...]
    shape: tuple[int, int, int, int]
    source_fps: float
    total_frames: int
    frames: Callable[[], Iterator[np.ndarray]]


def stream_clips(data: VideoData, rule: ClipRule, sampling: FrameSampling, *, timeout_s: float | None = None,
                 detector: Callable[[ClipRule, float], CutDetector] = CutDetector, threads: int = 1,
                 decoder=None, on_clip: Callable | None = None) -> Iterator[tuple[Clip, SampledClip | VlbatchError]]:
    """`decode_clips` without assembling the frames (the decoder child streams them into its ring).
    decoder: the `VideoDecoder` to open `data` with (default PyAV keeping every picture; tests pass a
    PyAV that hangs or crashes)."""
    if decoder is None:
        from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder

        decoder = PyAVDecoder(threads, skip_nonref=False)
    with decoder.open(data) as video:
        state = _State(video, rule, sampling, detector, timeout_s)
        state.on_clip = on_clip
        yield from state.run()


def decode_clips(data: VideoData, rule: ClipRule, sampling: FrameSampling, *, timeout_s: float | None = None,
                 detector: Callable[[ClipRule, float], CutDetector] = CutDetector,
                 threads: int = 1) -> Iterator[tuple[Clip, VideoClip | VlbatchError]]:
    """Yield each clip of `data` with its sampled frames (or the clip's own typed error: too many
    bytes to sample). `MediaError` for bytes that are not a video; `MediaTimeoutError` past
    `timeout_s` between two clips. `detector(rule, fps)`: the cut detector (a test passes one that fails)."""
    for clip, sampled in stream_clips(data, rule, sampling, timeout_s=timeout_s, detector=detector, threads=threads):
        if isinstance(sampled, VlbatchError):
            yield clip, sampled
            continue
        frames = np.empty(sampled.shape, np.uint8)
        for slot, frame in enumerate(sampled.frames()):
            frames[slot] = frame
        yield clip, VideoClip(frames=frames, source_fps=sampled.source_fps, total_frames=sampled.total_frames,
                              indices=sampled.indices)


class _State:
    """One video's pass: the planner, the detector, the held pictures."""

    def __init__(self, video, rule: ClipRule, sampling: FrameSampling, detector, timeout_s: float | None):
        self.video, self.rule, self.sampling, self.timeout_s = video, rule, sampling, timeout_s
        self.fps = float(video.info.fps)
        if not self.fps > 0:
            raise MediaError("the video has no frame rate; clips need one")
        self.held = _Held()
        self.on_clip = None  # decode_clips' hook
        self.detector = None
        from av.video.reformatter import VideoReformatter

        self.small = VideoReformatter()  # one swscale context for the detector's pictures (`small_bgr`)
        if rule.mode == "scenes":
            self.planner = ScenePlanner(rule, self.fps)
            try:
                self.detector = detector(rule, self.fps)
            except Exception:  # the library or its detector cannot start: fixed windows (clip_source says so)
                self.planner = FixedPlanner(rule, self.fps)
        else:
            self.planner = FixedPlanner(rule, self.fps)

    def _fall_back(self) -> None:
        p = self.planner
        self.detector = None
        self.planner = FixedPlanner(self.rule, self.fps, origin=p.keep_from, first_index=p.emitted)

    def _detect(self, i: int, frame) -> list[Clip]:
        try:
            cuts = self.detector.feed(i, small_bgr(frame, self.small))
        except Exception:  # a detector failing on this video: the rest in fixed windows
            self._fall_back()
            return []
        return [c for cut in cuts for c in self.planner.cut(cut)]

    def run(self) -> Iterator[tuple[Clip, VideoClip | VlbatchError]]:
        i, deadline = -1, self._deadline()
        for frame in self.video.stream_all():
            if frame.pts is None:
                continue
            i += 1
            if deadline is not None and time.monotonic() > deadline:
                raise MediaTimeoutError(f"decoding a clip took longer than the {self.timeout_s:g} s limit "
                                        f"(video.decode_timeout_s), at frame {i}")
            self.held.add(i, frame)
            clips = self._detect(i, frame) if self.detector is not None else []
            clips += self.planner.advance(i)
            for clip in clips:
                yield self._emit(clip)
                deadline = self._deadline()
            self.held.drop_before(self.planner.keep_from)
        if i < 0:
            raise MediaError("no frame of the video stream could be decoded")
        clips = []
        if self.detector is not None:
            try:
                clips = [c for cut in self.detector.finish(i) for c in self.planner.cut(cut)]
            except Exception:
                self._fall_back()
        for clip in clips + self.planner.finish(i + 1):
            yield self._emit(clip)

    def _emit(self, clip: Clip) -> tuple[Clip, VideoClip | VlbatchError]:
        """The clip and its sampling; its file (`on_clip`) only when it samples: an error row has none."""
        sampled = self._sample(clip)
        if self.on_clip is not None and not isinstance(sampled, VlbatchError):
            pictures = (self.held.get(j) for j in range(clip.start, clip.end))
            self.on_clip(clip, pictures, self.video.stream, rotation=self.video.info.rotation)
        return clip, sampled

    def _deadline(self) -> float | None:
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def _sample(self, clip: Clip) -> SampledClip | VlbatchError:
        try:
            rel = clip_indices(clip, self.sampling)
            h, w = self.video.info.height, self.video.info.width
            nbytes = len(rel) * h * w * 3
            if nbytes > self.sampling.max_output_bytes:
                raise InputError(f"clip {clip.index}: {len(rel)} sampled frames of {w}x{h} need "
                                 f"{nbytes / 2**30:.1f} GiB, over the {self.sampling.max_output_bytes / 2**30:.1f} "
                                 "GiB limit; sample fewer frames")
        except VlbatchError as e:
            return e
        indices = tuple(int(r) for r in rel)
        return SampledClip(indices=indices, shape=(len(indices), h, w, 3), source_fps=self.fps,
                           total_frames=clip.frames, frames=partial(self._frames, clip.start, indices))

    def _frames(self, start: int, indices: tuple[int, ...]) -> Iterator[np.ndarray]:
        for r in indices:
            yield self.video.to_rgb(self.held.get(start + r))
