"""Issue 60, item 15: a video's bytes are held once; the decoder child gets the file, never a copy over a pipe.

The structural fact is checked, not a memory figure (benchmarks/bench_video_decode.py `--big` measures the
process tree's peak RSS): a recording stand-in child (`tests/hostile_decoder.py` mode "record") says what each
request brought on the request channel (a small header, nothing behind it, one descriptor of the file), for a
local file the parent opened and for downloaded bytes. The real child decodes the same frames from the file as
from the bytes; what the parent checked is what the child reads, whatever is put at the path afterwards.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pytest

from vlbatch.devtools.samples import encode_video
from vlbatch.operators.errors import InputError, MediaError
from vlbatch.operators.media.clips import ClipRule
from vlbatch.operators.media.decoders import backend_problem
from vlbatch.operators.media.load import load_media
from vlbatch.operators.media.video import FrameSampling, decode_video_inprocess
from vlbatch.operators.media.worker import DecodeWorker
from vlbatch.operators.storage import memfd_of, open_media

HOSTILE = os.path.join(os.path.dirname(__file__), "hostile_decoder.py")
SAMPLING = FrameSampling(fps=4.0)


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("handoff") / "clip.mp4"
    encode_video(path, 40, 96, 64, 10, options={"bf": "2", "g": "8"})
    return path


def recorded(tmp_path, media) -> dict:
    marker = tmp_path / "record.json"
    with DecodeWorker(timeout_s=60, child_argv=[sys.executable, HOSTILE, "record", str(marker)]) as w:
        clip = w.decode(media, FrameSampling(fps=1.0))
    assert clip.frames.shape == (1, 2, 2, 3)  # the stand-in's answer came through
    return json.loads(marker.read_text())


@pytest.mark.parametrize("kind", ["local file", "downloaded bytes"])
def test_the_child_gets_the_file_not_its_bytes(tmp_path, video_path, kind):
    data = video_path.read_bytes()
    if kind == "local file":
        with open_media(str(video_path)) as media:
            got = recorded(tmp_path, media)
    else:
        got = recorded(tmp_path, data)  # bytes the caller holds: written once into a sealed memfd
    assert got["request_bytes"] < 4096 < len(data)  # a header only: no payload follows it
    assert got["behind"] == 0
    assert got["size"] == len(data) and got["sha256"] == [hashlib.sha256(data).hexdigest()]


def test_downloaded_bytes_become_a_sealed_memfd(video_path):
    data = video_path.read_bytes()
    with memfd_of(data) as media:
        assert media.size == len(data) and media.read_all() == data
        with pytest.raises(PermissionError):  # sealed: a compromised child cannot change what it was handed
            os.pwrite(media.fd, b"x", 0)
        assert os.readlink(f"/proc/self/fd/{media.fd}").startswith("/memfd:")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pyav", "decord", "torchcodec"])
def test_frames_from_the_file_equal_frames_from_bytes(video_path, backend):
    if backend_problem(backend):
        pytest.skip(backend_problem(backend))
    data = video_path.read_bytes()
    want = decode_video_inprocess(data, SAMPLING, backend)
    with DecodeWorker(timeout_s=60, max_calls=5) as w, open_media(str(video_path)) as media:
        from_file = w.decode(media, SAMPLING, backend)
        from_bytes = w.decode(data, SAMPLING, backend)
        assert w.starts == 1
    for got in (from_file, from_bytes):
        assert got.indices == want.indices and np.array_equal(got.frames, want.frames)


def test_clips_from_the_file_equal_clips_from_bytes(video_path):
    data = video_path.read_bytes()
    rule = ClipRule(mode="fixed", window_s=1.5)
    with DecodeWorker(timeout_s=60) as w, open_media(str(video_path)) as media:
        from_file = list(w.decode_clips(media, rule, SAMPLING))
        from_bytes = list(w.decode_clips(data, rule, SAMPLING))
    assert len(from_file) == len(from_bytes) > 1
    for (c1, v1), (c2, v2) in zip(from_file, from_bytes, strict=True):
        assert c1 == c2 and np.array_equal(v1.frames, v2.frames)


def test_the_child_reads_what_the_parent_checked(tmp_path, video_path):
    """The path is replaced after the check (another video renamed over it, then a FIFO): the child
    decodes the file the parent opened, and grown bytes past the checked size are never read."""
    path = tmp_path / "named.mp4"
    path.write_bytes(video_path.read_bytes())
    want = decode_video_inprocess(path.read_bytes(), SAMPLING, "pyav")
    other = tmp_path / "other.mp4"
    encode_video(other, 12, 32, 32, 10)
    with open_media(str(path)) as media, DecodeWorker(timeout_s=60) as w:
        os.replace(other, path)
        assert np.array_equal(w.decode(media, SAMPLING, "pyav").frames, want.frames)
        os.unlink(path)
        os.mkfifo(path)
        assert np.array_equal(w.decode(media, SAMPLING, "pyav").frames, want.frames)
    with pytest.raises(MediaError, match="not a regular file"):  # named now, a FIFO is refused as before
        open_media(str(path))


def test_open_media_refuses_as_read_bytes_does(tmp_path):
    loop_a, loop_b = tmp_path / "a.mp4", tmp_path / "b.mp4"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    with pytest.raises(MediaError, match="a.mp4"):
        open_media(str(loop_a))
    with pytest.raises(MediaError, match="a directory"):
        open_media(str(tmp_path))
    big = tmp_path / "big.mp4"
    big.write_bytes(b"\0" * 100)
    with pytest.raises(InputError, match="video.max_bytes limit of 99"):
        open_media(str(big), max_bytes=99, limit_name="video.max_bytes")


def test_load_media_hands_a_local_video_over_as_a_file(video_path):
    want = decode_video_inprocess(video_path.read_bytes(), SAMPLING, "pyav")
    got = load_media(str(video_path), sampling=SAMPLING, backend="pyav")
    assert np.array_equal(got.frames, want.frames)


@pytest.mark.slow
def test_a_downloaded_video_is_held_once_in_a_sealed_memfd(tmp_path, video_path):
    """http(s): `open_media` reads the bytes (read_bytes' rules) into a sealed memfd; the child decodes from it."""
    from held_http import HoldingServer

    (tmp_path / "clip.mp4").write_bytes(video_path.read_bytes())
    server = HoldingServer(tmp_path)
    try:
        media = open_media(f"{server.url}/clip.mp4")
    finally:
        server.close()
    want = decode_video_inprocess(video_path.read_bytes(), SAMPLING, "pyav")
    with media, DecodeWorker(timeout_s=60) as w:
        assert os.readlink(f"/proc/self/fd/{media.fd}").startswith("/memfd:")
        assert np.array_equal(w.decode(media, SAMPLING, "pyav").frames, want.frames)
