"""Video decoding on real files encoded in the test run (vlbatch.devtools.samples).

Checks which frame each backend returns (the frames carry their index as a bit
pattern), decord against PyAV pixel by pixel, sampled indices against
transformers' Qwen3VLVideoProcessor, rotation, the header-lies file, and that
every bad file gives a typed MediaError through the time-limited worker.
"""
from __future__ import annotations

import numpy as np
import pytest

from vlbatch.devtools.samples import frame_index, write_sample_videos
from vlbatch.operators.errors import InputError, MediaError, MediaTimeoutError
from vlbatch.operators.media.decoders import get_decoder
from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess
from vlbatch.operators.media.worker import DecodeWorker

# decord 0.6 ships its own FFmpeg build; both convert YUV 4:2:0 to RGB with swscale.
# Largest difference seen on these files: 0 (bit-identical); we allow 2 levels per channel
# so a different swscale build cannot flake the test while a wrong frame (mean diff > 20) fails.
PIXEL_TOLERANCE = 2


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return {v.name: v for v in write_sample_videos(tmp_path_factory.mktemp("videos"))}


@pytest.fixture(scope="module")
def worker():
    with DecodeWorker(timeout_s=20) as w:
        yield w


def good(videos):
    return [v for v in videos.values() if not v.bad and v.frames is not None]


def read(v) -> bytes:
    with open(v.path, "rb") as f:
        return f.read()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_every_frame_is_the_right_one_and_metadata_is_true(videos, backend):
    for v in good(videos):
        data = read(v)
        info = get_decoder(backend).probe(data)
        assert info.frames == v.frames, v.name
        assert info.header_frames == v.header_frames, v.name
        assert (info.width, info.height, info.rotation) == (v.width, v.height, v.rotation), v.name
        if v.constant_rate:
            assert info.fps == pytest.approx(v.fps), v.name
        # all frames, in a scrambled-but-sorted order with repeats: seeks forward, back-to-back and repeated
        idx = sorted([0, 0, v.frames - 1, v.frames // 2, v.frames // 2 + 1, 3, 3, v.frames - 2])
        frames = get_decoder(backend).decode(data, idx)
        assert frames.shape == (len(idx), v.height, v.width, 3)
        assert [frame_index(f) for f in frames] == idx, (v.name, backend)


def test_decord_matches_pyav_on_constant_rate_files(videos):
    seen = 0
    for v in good(videos):
        if not v.constant_rate:
            continue
        data = read(v)
        a = decode_video_inprocess(data, FrameSampling(num_frames=v.frames), "decord")
        b = decode_video_inprocess(data, FrameSampling(num_frames=v.frames), "pyav")
        assert a.indices == b.indices and a.total_frames == b.total_frames and a.source_fps == b.source_fps
        diff = np.abs(a.frames.astype(np.int16) - b.frames.astype(np.int16)).max()
        assert diff <= PIXEL_TOLERANCE, (v.name, diff)
        seen += 1
    assert seen >= 9


def test_variable_frame_rate_file_agrees_between_backends(videos):
    v = videos["vfr.mp4"]
    data = read(v)
    a = decode_video_inprocess(data, FrameSampling(fps=5), "decord")
    b = decode_video_inprocess(data, FrameSampling(fps=5), "pyav")
    assert a.indices == b.indices and a.source_fps == pytest.approx(b.source_fps)
    # average rate = frames / duration; the last frame lasts 33 ms (its pattern entry)
    span = float(v.note.split(", ")[1].split(" s")[0]) + 0.033
    assert a.source_fps == pytest.approx(v.frames / span, rel=0.02)
    assert [frame_index(f) for f in a.frames] == list(a.indices)
    assert [frame_index(f) for f in b.frames] == list(b.indices)


@pytest.mark.parametrize(
    "sampling",
    [FrameSampling(), FrameSampling(fps=8), FrameSampling(fps=30, min_frames=2, max_frames=9),
     FrameSampling(num_frames=5), FrameSampling(num_frames=4), FrameSampling(num_frames=60)],
)
def test_sampled_indices_match_qwen3vl_video_processor(videos, sampling):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    ref = Qwen3VLVideoProcessor(min_frames=sampling.min_frames, max_frames=sampling.max_frames)
    for name in ("h264_bframes.mp4", "vp9.webm", "mpeg4.avi", "vfr.mp4"):
        clip = decode_video_inprocess(read(videos[name]), sampling, "decord")
        meta = VideoMetadata(total_num_frames=clip.total_frames, fps=clip.source_fps)
        expected = ref.sample_frames(meta, num_frames=sampling.num_frames,
                                     fps=sampling.fps if sampling.num_frames is None else None)
        assert list(clip.indices) == expected.tolist(), name
        assert [frame_index(f) for f in clip.frames] == list(clip.indices)


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_rotated_videos_come_out_upright(videos, backend):
    for rot in (90, 180, 270):
        v = videos[f"rotated_{rot}.mp4"]
        clip = decode_video_inprocess(read(v), FrameSampling(num_frames=v.frames), backend)
        assert clip.frames.shape[1:3] == (160, 96)  # portrait as displayed; coded frames are 160 wide
        # the bit pattern only reads back in the displayed orientation
        assert [frame_index(f) for f in clip.frames] == list(range(v.frames)), (rot, backend)


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_header_claiming_more_frames_is_clamped_to_what_decodes(videos, worker, backend):
    v = videos["claims_more.mp4"]
    clip = worker.decode(read(v), FrameSampling(fps=25), backend)
    assert clip.total_frames < v.header_frames
    assert clip.indices[-1] == clip.total_frames - 1
    assert [frame_index(f) for f in clip.frames] == list(clip.indices)


def test_bad_files_raise_media_error_within_the_limit(videos, worker):
    bad = [v for v in videos.values() if v.bad]
    assert {v.name for v in bad} >= {"truncated.mp4", "zero.mp4", "audio_only.m4a", "not_media.mp4", "garbage.webm"}
    for backend in ("decord", "pyav"):
        for v in bad:
            with pytest.raises(MediaError) as e:
                worker.decode(read(v), FrameSampling(), backend)
            assert not isinstance(e.value, MediaTimeoutError), (v.name, backend)
            assert e.value.permanent
    assert worker.starts == 1  # bad files never cost a worker


def test_images_are_not_videos(worker, tmp_path):
    from PIL import Image

    from vlbatch.devtools.sample_images import gradient

    for fmt in ("PNG", "JPEG", "GIF", "WEBP"):
        path = tmp_path / f"x.{fmt.lower()}"
        Image.fromarray(gradient(32, 24)).save(path, format=fmt)
        with pytest.raises(MediaError, match="is an image"):
            worker.decode(path.read_bytes())


def test_sampling_errors_are_input_errors(videos, worker):
    with pytest.raises(InputError, match="mutually exclusive"):
        worker.decode(read(videos["vp9.webm"]), FrameSampling(fps=2, num_frames=4))
    # 8 frames of 160x96x3 = 368640 bytes: one byte over the limit is refused before decoding
    with pytest.raises(InputError, match="GiB limit"):
        worker.decode(read(videos["vp9.webm"]), FrameSampling(num_frames=8, max_output_bytes=368639))
    clip = worker.decode(read(videos["vp9.webm"]), FrameSampling(num_frames=8, max_output_bytes=368640))
    assert clip.frames.shape == (8, 96, 160, 3)
