"""Deterministic sample media for tests, the demo and benchmarks (no downloads).

Owns: real encoded videos written with PyAV (libx264 with B-frames in mp4, VP9 and VP8
(alt-ref frames) in webm, MPEG-4 Part 2 in avi, variable frame rate, odd frame counts, display-matrix
rotation) and deliberately bad files (truncated, zero bytes, audio only, a header
that claims more frames than the file holds, not media at all), plus a manifest of
what was written with the facts tests check against (`SampleVideo`). Images live
in `vlbatch.devtools.sample_images`.

Frame content identifies the frame: the top half of frame `i` carries the bits of
`i` as 16 black/white bars (two rows of 8, least significant bit first), so
`frame_index(frame)` tells WHICH source frame a decoder returned, robustly to lossy
coding. The bottom half has a moving block so encoders really use motion (B-frames).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

INDEX_BITS = 16


@dataclass(frozen=True)
class SampleVideo:
    """One generated file and what a correct decoder must report for it.

    frames: decodable frames (None for files that must fail); header_frames: what the
    container claims (None where the container stores no count); fps: average frame
    rate; width/height: upright (displayed) size; rotation: display rotation in
    degrees counter-clockwise; bad: decoding must raise `MediaError`.
    """

    name: str
    path: str
    codec: str | None
    frames: int | None
    header_frames: int | None
    fps: float | None
    width: int | None
    height: int | None
    rotation: int = 0
    constant_rate: bool = True
    bad: bool = False
    note: str = ""


def index_pattern(i: int, width: int, height: int, phase: int | None = None) -> np.ndarray:
    """[H, W, 3] uint8 frame whose top half encodes `i` (see module docstring)."""
    img = np.full((height, width, 3), 24, np.uint8)
    bw, bh = width // 8, height // 4
    for b in range(INDEX_BITS):
        if (i >> b) & 1:
            r, c = divmod(b, 8)
            img[r * bh:(r + 1) * bh, c * bw:(c + 1) * bw] = 232
    p = i if phase is None else phase
    side = max(4, height // 6)
    x = (p * 5) % max(1, width - side)
    img[height // 2 + 2:height // 2 + 2 + side, x:x + side] = (200, 60, 40)
    img[height - 2:, :] = np.uint8((p * 3) % 256)
    return img


def frame_index(frame: np.ndarray) -> int:
    """Read back the index encoded by `index_pattern` from an upright [H, W, 3] frame."""
    h, w = frame.shape[:2]
    bw, bh = w // 8, h // 4
    gray = frame.astype(np.float32).mean(axis=2)
    value = 0
    for b in range(INDEX_BITS):
        r, c = divmod(b, 8)
        cell = gray[r * bh + bh // 4:(r + 1) * bh - bh // 4, c * bw + bw // 4:(c + 1) * bw - bw // 4]
        if cell.mean() > 128:
            value |= 1 << b
    return value


def encode_video(
    path: Path,
    n: int,
    width: int,
    height: int,
    fps: float,
    *,
    codec: str = "libx264",
    options: dict | None = None,
    container_options: dict | None = None,
    rotation: int = 0,
    durations_ms: list[int] | None = None,
    audio: bool = False,
    pattern=index_pattern,
) -> None:
    """Encode `n` frames of `pattern(i, width, height)` (upright) into `path`.

    rotation: display rotation (degrees CCW) written to the container; the coded
    frames are the upright ones rotated back, so a correct player shows `pattern`.
    durations_ms: per-frame display durations for a variable frame rate stream.
    audio: also write an AAC track (a tone) interleaved with the video.
    """
    import av

    k = (rotation // 90) % 4
    coded_w, coded_h = (height, width) if k % 2 else (width, height)
    # bitexact: no random Matroska segment UID / encoder strings, so the bytes are reproducible
    out = av.open(str(path), "w", options={"fflags": "+bitexact", **(container_options or {})})
    try:
        stream = _video_stream(out, codec, fps, coded_w, coded_h, options)
        if rotation:
            stream.set_display_rotation(rotation)
        if durations_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        tone = _tone_stream(out) if audio else None  # every stream exists before the first packet
        t = done = 0
        for i in range(n):
            upright = np.ascontiguousarray(np.rot90(pattern(i, width, height), -k))
            frame = av.VideoFrame.from_ndarray(upright, format="rgb24")
            if durations_ms is not None:
                frame.pts, frame.time_base = t, Fraction(1, 1000)
                t += durations_ms[i % len(durations_ms)]
            for packet in stream.encode(frame):
                out.mux(packet)
            if tone is not None:  # interleave: audio up to the end of this frame
                done = _write_tone(out, tone, done, int((i + 1) / fps * tone.rate) // 1024 * 1024)
        for packet in stream.encode():
            out.mux(packet)
        if tone is not None:
            _write_tone(out, tone, done, int(n / fps * tone.rate), flush=True)
    finally:
        out.close()


def _video_stream(out, codec: str, fps: float, width: int, height: int, options: dict | None):
    """A video stream of `out` whose bytes are reproducible (one encoder thread, x264 without asm)."""
    stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
    stream.width, stream.height = width, height
    stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    opts = dict(options or {})
    if codec == "libx264":  # x264's assembly gave different bytes from one process to the next
        # on an AVX-512 EPYC (2026-11-30: PyAV 18.1 / FFmpeg 8; the lookahead reads memory
        # it did not write, so the output followed the heap's garbage); its C code does not
        opts["x264-params"] = ":".join(filter(None, [opts.get("x264-params"), "asm=0"]))
    stream.options = opts
    # one encoder thread: x264, libvpx and mpeg4 size their threads by the CPUs the process
    # may use (its affinity), and the bytes depend on the thread count
    stream.codec_context.thread_count = 1
    return stream


def _tone_stream(out, rate: int = 16000):
    stream = out.add_stream("aac", rate=rate)
    stream.layout = "mono"
    return stream


def _write_tone(out, stream, start: int, stop: int, flush: bool = False) -> int:
    """Encode samples [start, stop) of a 440 Hz tone into the AAC `stream` of `out`; returns `stop`."""
    import av

    rate = stream.rate
    for a in range(start, stop, 1024):
        t = np.arange(a, min(a + 1024, stop)) / rate
        frame = av.AudioFrame.from_ndarray((0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None],
                                           format="fltp", layout="mono")
        frame.sample_rate, frame.pts = rate, a
        for packet in stream.encode(frame):
            out.mux(packet)
    if flush:
        for packet in stream.encode():
            out.mux(packet)
    return stop


def encode_audio_only(path: Path, seconds: float = 1.0, rate: int = 16000) -> None:
    """An AAC-in-mp4 file with no video stream (a decoder must refuse it)."""
    import av

    out = av.open(str(path), "w", options={"fflags": "+bitexact"})
    try:
        _write_tone(out, _tone_stream(out, rate), 0, int(seconds * rate), flush=True)
    finally:
        out.close()


H264_BFRAMES = {"bf": "3", "g": "12", "crf": "16", "preset": "fast"}
VFR_DURATIONS_MS = [33, 33, 100, 50]


def write_sample_videos(out_dir: str | Path) -> list[SampleVideo]:
    """Write the video sample set into `out_dir` (about 0.5 s on one core); return its manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s: list[SampleVideo] = []

    def add(name, codec, n, w, h, fps, header=True, **kw):
        s.append(SampleVideo(name, str(out / name), codec, n, n if header else None, fps, w, h, **kw))

    encode_video(out / "h264_bframes.mp4", 37, 160, 96, 25, options=H264_BFRAMES)
    add("h264_bframes.mp4", "h264", 37, 160, 96, 25.0, note="H.264 High, 3 B-frames, GOP 12")
    encode_video(out / "h264_even.mp4", 48, 128, 72, 30, options=H264_BFRAMES,
                 container_options={"movflags": "+faststart"})
    add("h264_even.mp4", "h264", 48, 128, 72, 30.0, note="moov first (faststart)")
    encode_video(out / "h264_with_audio.mp4", 25, 96, 64, 25, options=H264_BFRAMES, audio=True)
    add("h264_with_audio.mp4", "h264", 25, 96, 64, 25.0, note="plus an AAC track")
    encode_video(out / "vp9.webm", 31, 160, 96, 30, codec="libvpx-vp9",
                 options={"crf": "18", "b": "0", "deadline": "realtime", "cpu-used": "8", "g": "10"})
    add("vp9.webm", "vp9", 31, 160, 96, 30.0, header=False, note="Matroska stores no frame count")
    encode_video(out / "vp8_altref.webm", 45, 160, 96, 24, codec="libvpx",
                 options={"crf": "10", "b": "1M", "auto-alt-ref": "1", "lag-in-frames": "16", "g": "15",
                          "deadline": "good", "cpu-used": "4"})
    add("vp8_altref.webm", "vp8", 45, 160, 96, 24.0, header=False, note="VP8 with alt-ref (hidden) frames")
    encode_video(out / "mpeg4.avi", 29, 96, 64, 15, codec="mpeg4", options={"qscale": "2", "g": "8"})
    add("mpeg4.avi", "mpeg4", 29, 96, 64, 15.0, note="MPEG-4 Part 2 in AVI")
    encode_video(out / "vfr.mp4", 23, 96, 64, 30, options=H264_BFRAMES, durations_ms=VFR_DURATIONS_MS)
    span_s = sum(VFR_DURATIONS_MS[i % 4] for i in range(22)) / 1000  # first to last frame start
    s.append(SampleVideo("vfr.mp4", str(out / "vfr.mp4"), "h264", 23, 23, None, 96, 64,
                         constant_rate=False, note=f"variable frame rate, {span_s:.3f} s from first to last frame"))
    for rot in (90, 180, 270):
        name = f"rotated_{rot}.mp4"
        encode_video(out / name, 13, 96, 160, 25, options=H264_BFRAMES, rotation=rot)
        add(name, "h264", 13, 96, 160, 25.0, rotation=rot, note="display matrix; coded frames are sideways")
    _write_bad_files(out, s)
    manifest = out / "videos.json"
    manifest.write_text(json.dumps([asdict(v) for v in s], indent=1))
    return s


def _write_bad_files(out: Path, s: list[SampleVideo]) -> None:
    """Files a decoder must reject (or clamp, for the short one) without hanging."""
    encode_video(out / "_long.mp4", 120, 160, 96, 25, options={"bf": "3", "g": "30", "crf": "16"},
                 container_options={"movflags": "+faststart"})
    full = (out / "_long.mp4").read_bytes()
    (out / "_long.mp4").unlink()
    (out / "claims_more.mp4").write_bytes(full[: len(full) // 2])
    s.append(SampleVideo("claims_more.mp4", str(out / "claims_more.mp4"), "h264", None, 120, 25.0, 160, 96,
                         note="moov says 120 frames, the data was cut in half: decoders must clamp"))
    encode_video(out / "_tail.mp4", 40, 96, 64, 25, options=H264_BFRAMES)
    tail = (out / "_tail.mp4").read_bytes()
    (out / "_tail.mp4").unlink()
    bad = {
        "truncated.mp4": (tail[: len(tail) // 2], "moov at the end was cut off"),
        "zero.mp4": (b"", "zero bytes"),
        "not_media.mp4": (b"this is a text file, not a video\n" * 40, "text with a video extension"),
        "garbage.webm": (np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "random bytes"),
    }
    for name, (data, note) in bad.items():
        (out / name).write_bytes(data)
        s.append(SampleVideo(name, str(out / name), None, None, None, None, None, None, bad=True, note=note))
    encode_audio_only(out / "audio_only.m4a")
    s.append(SampleVideo("audio_only.m4a", str(out / "audio_only.m4a"), None, None, None, None, None, None,
                         bad=True, note="AAC audio, no video stream"))


def write_all(out_dir: str | Path) -> dict:
    """Write videos and images into `out_dir`; returns `{"videos": [...], "images": [...]}` (also manifest.json)."""
    from vlbatch.devtools.sample_images import write_sample_images

    out = Path(out_dir)
    videos = write_sample_videos(out / "videos")
    images = write_sample_images(out / "images")
    manifest = {"videos": [asdict(v) for v in videos], "images": [asdict(i) for i in images]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write vlbatch's sample images and videos (deterministic).")
    parser.add_argument("out", help="output folder")
    args = parser.parse_args(argv)
    manifest = write_all(args.out)
    for kind in ("videos", "images"):
        for item in manifest[kind]:
            print(f"{kind[:-1]:5s} {item['path']}  {item.get('note', '')}")
    print(f"manifest: {Path(args.out) / 'manifest.json'}")


if __name__ == "__main__":
    main()
