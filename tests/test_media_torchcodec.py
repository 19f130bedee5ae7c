"""The TorchCodec backend against the PyAV reference, PyAV's sparse decode against its full decode,
`video.decoder: auto`, and the plumbing of decode on a device (issue 35).

Real files encoded in the test run (vlbatch.devtools.samples: B-frames, VFR, VP8 alt-ref, rotation,
a header claiming more frames than the data holds, truncated and non-video files) plus a long-GOP
clip made here. Frames carry their index as a bit pattern, so a wrong frame is seen as such.

TorchCodec needs FFmpeg's shared libraries on the system. Where they are missing these tests skip,
unless VLBATCH_REQUIRE_TORCHCODEC=1 (set by .ci/run, which installs them): then they fail.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from vlbatch.devtools.samples import encode_video, frame_index, write_sample_videos
from vlbatch.operators.errors import ConfigError, MediaError
from vlbatch.operators.media.decoders import AUTO_ORDER, backend_problem, get_decoder, resolve_backend
from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder
from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess
from vlbatch.operators.media.worker import DecodeWorker

PROBLEM = backend_problem("torchcodec")
# required (CI) or present: run, and fail if it cannot decode
needs_torchcodec = pytest.mark.skipif(bool(PROBLEM) and os.environ.get("VLBATCH_REQUIRE_TORCHCODEC") != "1",
                                      reason=PROBLEM or "")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return {v.name: v for v in write_sample_videos(tmp_path_factory.mktemp("videos"))}


@pytest.fixture(scope="module")
def long_gop(tmp_path_factory):
    """300 frames, one keyframe every 250, 3 B-frames with a pyramid (non-reference B-frames)."""
    path = tmp_path_factory.mktemp("gop") / "long_gop.mp4"
    encode_video(path, 300, 96, 64, 25, options={"bf": "3", "g": "250", "keyint_min": "250", "crf": "20",
                                                 "preset": "fast", "sc_threshold": "0"})
    return path.read_bytes()


def good(videos):
    return [v for v in videos.values() if not v.bad and v.frames is not None]


def read(v) -> bytes:
    with open(v.path, "rb") as f:
        return f.read()


@pytest.mark.slow
@needs_torchcodec
def test_torchcodec_is_frame_exact_against_pyav_on_every_sample(videos, long_gop):
    cases = [(v.name, read(v)) for v in good(videos)] + [("long_gop.mp4", long_gop)]
    for name, data in cases:
        ref_info = get_decoder("pyav").probe(data)
        info = get_decoder("torchcodec").probe(data)
        assert info == ref_info, name  # the same metadata: the shared probe
        n = info.frames
        idx = sorted([0, 0, n - 1, n // 2, n // 2 + 1, 3, 3, n - 2, n // 3])
        got = get_decoder("torchcodec").decode(data, idx)
        ref = get_decoder("pyav").decode(data, idx)
        assert got.shape == (len(idx), info.height, info.width, 3) and got.dtype == np.uint8, name
        assert [frame_index(f) for f in got] == idx, name
        assert np.array_equal(got, ref), name  # bit for bit: both are FFmpeg + swscale


@needs_torchcodec
def test_torchcodec_sampled_clips_equal_pyav_including_vfr_and_rotation(videos):
    for name in ("vfr.mp4", "rotated_90.mp4", "rotated_180.mp4", "rotated_270.mp4", "vp8_altref.webm"):
        data = read(videos[name])
        for sampling in (FrameSampling(fps=5), FrameSampling(num_frames=7)):
            a = decode_video_inprocess(data, sampling, "torchcodec")
            b = decode_video_inprocess(data, sampling, "pyav")
            assert (a.indices, a.total_frames, a.source_fps) == (b.indices, b.total_frames, b.source_fps), name
            assert np.array_equal(a.frames, b.frames), name


@pytest.mark.slow
@needs_torchcodec
def test_torchcodec_in_the_worker_clamps_lying_headers_and_types_bad_files(videos):
    with DecodeWorker(timeout_s=60, preload="torchcodec") as w:  # the child imports torchcodec before "ready"
        v = videos["claims_more.mp4"]
        clip = w.decode(read(v), FrameSampling(fps=25), "torchcodec")
        assert 0 < clip.total_frames < v.header_frames  # clamped to what decodes
        assert [frame_index(f) for f in clip.frames] == list(clip.indices)
        ref = w.decode(read(v), FrameSampling(fps=25), "pyav")
        assert (clip.indices, clip.total_frames) == (ref.indices, ref.total_frames)
        assert np.array_equal(clip.frames, ref.frames)
        for bad in (x for x in videos.values() if x.bad):
            with pytest.raises(MediaError):
                w.decode(read(bad), FrameSampling(fps=2), "torchcodec")
        ok = w.decode(read(videos["h264_bframes.mp4"]), FrameSampling(fps=2), "torchcodec")  # the child survived
        assert [frame_index(f) for f in ok.frames] == list(ok.indices)


def test_pyav_sparse_decode_skips_non_reference_pictures_and_keeps_every_frame(long_gop):
    idx = FrameSampling(fps=2).indices(PyAVDecoder().probe(long_gop))
    with PyAVDecoder(skip_nonref=False).open(long_gop) as full:
        want = np.stack(list(full.iter_frames(idx)))
        full_count = full.decoded
    with PyAVDecoder().open(long_gop) as sparse:
        got = np.stack(list(sparse.iter_frames(idx)))
        sparse_count = sparse.decoded
    assert np.array_equal(got, want)  # bit-identical: skipped pictures are never referenced
    assert [frame_index(f) for f in got] == idx.tolist()
    assert sparse_count < full_count * 0.8, (sparse_count, full_count)  # the B-frames were not decoded


def test_pyav_sparse_decode_is_exact_on_every_sample(videos):
    for v in good(videos):
        data = read(v)
        n = v.frames
        idx = sorted({0, n // 4, n // 2, n - 1})
        a = PyAVDecoder().decode(data, idx)
        b = PyAVDecoder(skip_nonref=False).decode(data, idx)
        assert np.array_equal(a, b), v.name


def test_auto_picks_the_first_working_backend_of_the_measured_order():
    working = [b for b in AUTO_ORDER if backend_problem(b) is None]
    assert resolve_backend("auto") == working[0]
    assert get_decoder("auto").name == working[0]
    assert resolve_backend("decord") == "decord"  # decord stays a supported choice
    assert get_decoder("decord").name == "decord"
    with pytest.raises(ConfigError, match="^video.decoder: unknown video decoder 'ffmpeg'; "
                                          "allowed: auto, torchcodec, pyav, decord$"):  # DECODERS' words
        get_decoder("ffmpeg")


def test_video_config_decoder_defaults_to_auto_and_accepts_the_old_name():
    from vlbatch.pipeline.config import VideoSection

    assert VideoSection().decoder == "auto" and VideoSection().decode_device == "cpu"
    assert VideoSection(backend="pyav").decoder == "pyav"
    assert VideoSection(decoder="torchcodec").decoder == "torchcodec"


@pytest.mark.slow
def test_validate_without_torchcodec_says_what_to_install_in_one_line(tmp_path, tiny_ckpt):
    """A stand-in `torchcodec` module that fails to import plays a machine without it (the real one is
    installed here); `vlbatch validate` must name the field and what to install, before any work."""
    from test_jobs_support import vlbatch, write_job

    from vlbatch.jobs.errors import EXIT_USAGE

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torchcodec.py").write_text("raise ImportError('No module named torchcodec')\n")
    cfg = write_job(tmp_path / "job", tiny_ckpt("dense"), n_images=1)
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), *filter(None, sys.path)])}
    bad = vlbatch("validate", str(cfg), "--set", "video.decoder=torchcodec", env=env)
    assert bad.returncode == EXIT_USAGE, bad.stderr
    lines = [ln for ln in bad.stderr.splitlines() if "video.decoder" in ln]
    assert len(lines) == 1 and "apt-get install libavcodec59" in lines[0] and "pip install" in lines[0], bad.stderr
    ok = vlbatch("validate", str(cfg), "--set", "video.decoder=auto", env=env)  # auto falls back quietly
    assert ok.returncode == 0, ok.stderr
    gpu = vlbatch("validate", str(cfg), "--set", "video.decode_device=cuda", "--set", "model.device=cpu")
    assert gpu.returncode == EXIT_USAGE, gpu.stderr
    lines = [ln for ln in gpu.stderr.splitlines() if "video.decode_device" in ln]
    assert len(lines) == 1 and "model.device is cpu" in lines[0], gpu.stderr


def test_decode_device_refuses_cleanly_where_cuda_cannot_decode():
    import torch

    from vlbatch.operators.media.gpu_decode import check_decode_device, decode_device_problem

    assert decode_device_problem("cpu", "cpu") is None
    with pytest.raises(ConfigError, match="model.device is cpu"):
        check_decode_device("cuda", "cpu")
    why = decode_device_problem("cuda", "auto")
    if torch.cuda.is_available() and PROBLEM is None:
        assert why is None
    else:
        assert why is not None and ("no CUDA device" in why or "torchcodec" in why)


@needs_torchcodec
def test_decode_on_device_plumbing_gives_the_cpu_paths_frames(videos):
    """`decode_on_device` with the CPU as the device: the same sampling, indices and uint8 frames as the
    CPU path, as a torch tensor; a file cut short falls back to PyAV's recount."""
    from vlbatch.operators.media.gpu_decode import decode_on_device

    for name, sampling in (("h264_bframes.mp4", FrameSampling(num_frames=9)), ("vfr.mp4", FrameSampling(fps=5)),
                           ("rotated_270.mp4", FrameSampling(fps=2)), ("claims_more.mp4", FrameSampling(fps=25))):
        data = read(videos[name])
        got = decode_on_device(data, sampling, "cpu")
        ref = decode_video_inprocess(data, sampling, "pyav")
        assert (got.indices, got.total_frames, got.source_fps) == (ref.indices, ref.total_frames, ref.source_fps)
        assert str(got.frames.device) == "cpu" and got.frames.dtype.is_floating_point is False, name
        assert np.array_equal(got.frames.numpy(), ref.frames), name


def test_sparse_samples_seek_to_keyframes_instead_of_decoding_every_frame(long_gop):
    """Two samples, at frame 0 and frame 299 (keyframes at 0 and 250): the decoder seeks to 250 and
    decodes from there, not the 300 frames between; the frames are still the right ones."""
    with PyAVDecoder(skip_nonref=False).open(long_gop) as video:
        frames = list(video.iter_frames([0, 299]))
        assert [frame_index(f) for f in frames] == [0, 299]
        assert video.decoded < 100, video.decoded
