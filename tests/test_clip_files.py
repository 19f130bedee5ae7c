"""Clip files (issue 51, `output.clip_files`): each clip re-encoded from the one decode's pictures into
`<run>/clips/<id>.mp4`, frame-exact (PyAV reads back exactly the clip's frames, timestamps relative to
the clip's start), on local disk and on S3 (moto's server mode), atomically, never rewritten on resume;
the `clip_uri` column; `validate` refusing an unknown format or codec by its field name.

The stage passed to `clip_rows` is a plain namespace holding what a `DecodeStage` holds (its config
parts and its real decoder child, which decodes and encodes); everything else is real (PyAV, fsspec, moto)."""
from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
from test_clips import scenes_pattern

from vlbatch.devtools.samples import encode_video
from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.clip_files import ClipFileSettings, ClipTarget, ClipWriter
from vlbatch.operators.media.clips import ClipRule
from vlbatch.operators.media.video import FrameSampling
from vlbatch.operators.media.worker import DecodeWorker
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA, OutputRow, rows_to_table
from vlbatch.operators.storage import StorageOptions
from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.stages.clip_rows import clip_rows
from vlbatch.pipeline.stages.rows import Decoded, MediaTask, from_table, to_table

MIN = {"model": {"path": "m"}, "input": {"uri": "in.parquet"}, "output": {"uri": "out"}}
FPS = 10
N = 95  # 9.5 s at 10 fps
@pytest.fixture(scope="module")
def video(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("clipfiles") / "scenes.mp4"
    encode_video(path, N, 128, 96, FPS, options={"g": "12", "bf": "2"}, pattern=scenes_pattern)
    return path.read_bytes()


@pytest.fixture(scope="module")
def worker():
    """The real killable decoder child (it decodes and encodes the clip files), one for the module."""
    with DecodeWorker(timeout_s=60) as w:
        yield w


def _stage(worker: DecodeWorker, rule: ClipRule, target: ClipTarget | None, done=None):
    return SimpleNamespace(clips=rule, sampling=FrameSampling(fps=2.0), worker=worker, done=done, clip_target=target)


def _row(uri: str = "videos/scenes.mp4") -> MediaTask:
    return MediaTask(media_uri=uri, media_type="video", ids=("a" * 32, "b" * 32), request_indices=(0, 1),
                     prompts=("caption it", "what colour?"))


def _read_back(fs, uri: str) -> list[float]:
    """The presentation times (seconds) of every frame the clip file decodes to."""
    import io

    import av

    with fs.open(uri, "rb") as f:
        data = f.read()
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        assert s.average_rate == FPS
        return [float(fr.pts * fr.time_base) for fr in c.decode(s)]


def _check_frame_exact(rows: list[Decoded], fs) -> None:
    assert rows and all(r.status == "ok" and r.clip_uri for r in rows)
    assert len({r.clip_uri for r in rows}) == len(rows)  # one file per clip
    for r in rows:
        times = _read_back(fs, r.clip_uri)
        frames = round((r.clip_end_s - r.clip_start_s) * FPS)
        assert len(times) == frames, (r.clip_index, len(times), frames)
        # relative to the clip's start: frame j at j / fps (the source's rate and timestamps kept)
        assert times[0] == pytest.approx(0.0, abs=1e-6)
        assert times[-1] == pytest.approx((frames - 1) / FPS, abs=1e-3)


def _local(tmp_path) -> ClipTarget:
    return ClipTarget(folder=str(tmp_path / "run" / "clips"), settings=ClipFileSettings(), storage=StorageOptions())


def test_fixed_window_clip_files_are_frame_exact(video, tmp_path, worker):
    import fsspec

    target = _local(tmp_path)
    rows = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=2.0, min_clip_s=0.5), target), _row(),
                          lambda _r: video))
    assert [(r.clip_start_s, r.clip_end_s) for r in rows] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9.5)]
    assert all(r.clip_uri.startswith(target.folder + "/") and r.clip_uri.endswith(".mp4") for r in rows)
    _check_frame_exact(rows, fsspec.filesystem("file"))
    # the same clip of the same media is the same file name on every run (resume finds it)
    again = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=2.0, min_clip_s=0.5), target), _row(),
                           lambda _r: video))
    assert [r.clip_uri for r in again] == [r.clip_uri for r in rows]
    assert not [p for p in (tmp_path / "run" / "clips").iterdir() if not p.name.endswith(".mp4")]  # no debris


def test_scene_clip_files_are_frame_exact(video, tmp_path, worker):
    import fsspec

    rows = list(clip_rows(_stage(worker, ClipRule(mode="scenes", window_s=5.0, min_clip_s=0.5), _local(tmp_path)), _row(),
                          lambda _r: video))
    assert {r.clip_source for r in rows} == {"scenes"}
    _check_frame_exact(rows, fsspec.filesystem("file"))


@pytest.mark.slow
def test_clip_files_on_s3(video, s3_server, worker):
    from vlbatch.operators.storage import filesystem

    s3_server.client().create_bucket(Bucket="clip-files-test")
    storage = StorageOptions(endpoint_url=s3_server.endpoint_url, region=s3_server.region)
    target = ClipTarget(folder="s3://clip-files-test/out/run/clips", settings=ClipFileSettings(), storage=storage)
    rows = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=3.0, min_clip_s=0.5), target), _row(),
                          lambda _r: video))
    assert len(rows) == 4 and all(r.clip_uri.startswith("s3://clip-files-test/out/run/clips/") for r in rows)
    fs, _ = filesystem(target.folder, storage)
    _check_frame_exact(rows, fs)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket="clip-files-test")["Contents"]]
    assert sorted(keys) == sorted(r.clip_uri.removeprefix("s3://clip-files-test/") for r in rows)


def test_a_clip_file_already_there_is_not_rewritten(video, tmp_path, worker):
    target = _local(tmp_path)
    rule = ClipRule(mode="fixed", window_s=3.0, min_clip_s=0.5)
    first = list(clip_rows(_stage(worker, rule, target), _row(), lambda _r: video))
    path = first[1].clip_uri
    with open(path, "wb") as f:  # a marker: a rewrite would replace it
        f.write(b"already here")
    again = list(clip_rows(_stage(worker, rule, target), _row(), lambda _r: video))
    assert [r.clip_uri for r in again] == [r.clip_uri for r in first]
    with open(path, "rb") as f:
        assert f.read() == b"already here"


def test_a_clip_that_is_an_error_row_gets_no_clip_file(video, tmp_path, worker):
    """Issue 60 item 6: 3 s windows sampled at 2 fps are 6 frames, over a 2-frame byte limit: their rows are
    error rows and no file is written for them; the last 0.5 s window samples 1 frame: ok, with its file."""
    target = _local(tmp_path)
    sampling = FrameSampling(fps=2.0, min_frames=1, max_output_bytes=2 * 128 * 96 * 3)
    stage = SimpleNamespace(clips=ClipRule(mode="fixed", window_s=3.0, min_clip_s=0.5), sampling=sampling,
                            worker=worker, done=None, clip_target=target)
    rows = list(clip_rows(stage, _row(), lambda _r: video))
    assert [(r.clip_index, r.status, r.error_type) for r in rows] == [
        (0, "error", "InputError"), (1, "error", "InputError"), (2, "error", "InputError"), (3, "ok", None)]
    assert [r.clip_uri is None for r in rows] == [True, True, True, False] and len(rows[3].frames) == 1
    assert sorted(p.name for p in (tmp_path / "run" / "clips").iterdir()) == [rows[3].clip_uri.rsplit("/", 1)[1]]


def test_without_clip_files_clip_uri_is_null(video, worker):
    rows = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=3.0), None), _row(), lambda _r: video))
    assert rows and all(r.clip_uri is None for r in rows)
    back = from_table(to_table(rows, Decoded), Decoded)  # the column travels between stages
    assert [r.clip_uri for r in back] == [None] * len(rows)


def test_clip_uri_travels_and_is_an_output_column(video, tmp_path, worker):
    rows = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=3.0), _local(tmp_path)), _row(), lambda _r: video))
    back = from_table(to_table(rows, Decoded), Decoded)
    assert [r.clip_uri for r in back] == [r.clip_uri for r in rows]
    assert OUTPUT_SCHEMA.field("clip_uri").type == "string" and OUTPUT_SCHEMA.field("clip_uri").nullable
    t = rows_to_table([OutputRow(id="x", request_index=0, media_uri="v.mp4", media_type="video", prompt="p",
                                 status="ok", model="m", run_id="r", clip_uri=rows[0].clip_uri)])
    assert t["clip_uri"].to_pylist() == [rows[0].clip_uri]


def test_writer_refuses_to_leave_a_half_file(tmp_path):
    """An encode that fails (timestamps going back: the muxer refuses them) leaves no file under the final
    name, and no debris."""
    import av

    def frame(i: int):
        f = av.VideoFrame(64, 48, "yuv420p")
        f.pts, f.time_base = i, Fraction(1, FPS)
        return f

    target = _local(tmp_path)
    w = ClipWriter(target, "bad", rate=Fraction(FPS), time_base=Fraction(1, FPS), width=64, height=48)
    w.add(frame(0))
    with pytest.raises(av.FFmpegError):
        for i in (1, 2, 3, 3, 3, 2, 1):
            w.add(frame(i))
        w.close()
    w.abort()
    assert list((tmp_path / "run" / "clips").iterdir()) == []


@pytest.mark.parametrize(("clip_files", "field"), [
    ({"format": "avi"}, "output.clip_files.format"),
    ({"codec": "no-such-codec"}, "output.clip_files.codec"),
    ({"codec": "aac"}, "output.clip_files.codec"),  # an audio codec
    ({"crf": 99}, "output.clip_files.crf"),
    ({"preset": "warp"}, "output.clip_files.preset"),
])
def test_validate_refuses_bad_clip_files_by_name(clip_files, field):
    with pytest.raises(ConfigError) as e:
        validate_config({**MIN, "output": {"uri": "out", "clip_files": clip_files},
                         "video": {"clips": {"mode": "fixed"}}})
    assert field in str(e.value)


def test_clip_files_config_defaults_and_off_by_default():
    assert validate_config(MIN).output.clip_files is None
    cfg = validate_config({**MIN, "output": {"uri": "out", "clip_files": {"format": "mp4"}},
                           "video": {"clips": {"mode": "fixed"}}})
    s = cfg.output.clip_files.settings()
    assert s == ClipFileSettings(format="mp4", codec="libx264", crf=23, preset="veryfast")


def test_clip_files_without_clips_are_refused():
    with pytest.raises(ConfigError, match="output.clip_files"):
        validate_config({**MIN, "output": {"uri": "out", "clip_files": {"format": "mp4"}}})


def test_a_clip_file_the_codec_refuses_keeps_the_rows_ok_without_a_uri(tmp_path, caplog, worker):
    """mpeg4 takes 4:2:0 only, and an odd-sized clip is encoded 4:4:4: the encoder refuses. The captions
    stand (ok rows, clip_uri null), the log names the clip, and no file is left."""
    path = tmp_path / "odd.mp4"
    encode_video(path, 30, 65, 49, FPS, codec="mpeg4")
    target = ClipTarget(folder=str(tmp_path / "run" / "clips"), settings=ClipFileSettings(codec="mpeg4"),
                        storage=StorageOptions())
    with caplog.at_level("WARNING", logger="vlbatch.clip_files"):
        rows = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=1.0), target), _row(),
                              lambda _r: path.read_bytes()))
    assert len(rows) == 3 and all(r.status == "ok" and r.clip_uri is None and r.frames.size for r in rows)
    assert "clip 0 of videos/scenes.mp4: no clip file (encoding clip file" in caplog.text and "mpeg4" in caplog.text
    assert not (tmp_path / "run" / "clips").exists() or list((tmp_path / "run" / "clips").iterdir()) == []


def test_a_clip_file_that_cannot_be_stored_fails_its_rows_for_resume(video, tmp_path, worker):
    """The clips folder cannot be made (a file holds its name): each clip's rows are error rows (redone on
    resume, file included), the video's other clips still come out, and the rows keep their clip columns."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "clips").write_bytes(b"not a folder")
    rows = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=3.0, min_clip_s=0.5), _local(tmp_path)), _row(),
                          lambda _r: video))
    assert [r.clip_index for r in rows] == [0, 1, 2, 3]
    assert all(r.status == "error" and r.error_type in ("FileExistsError", "NotADirectoryError", "StorageError")
               and r.clip_uri is None for r in rows), [(r.status, r.error_type) for r in rows]


def test_a_killed_writers_temp_files_are_cleaned_and_nothing_else(video, tmp_path, worker):
    from vlbatch.operators.media.clip_files import clean_debris

    target = _local(tmp_path)
    rows = list(clip_rows(_stage(worker, ClipRule(mode="fixed", window_s=5.0), target), _row(), lambda _r: video))
    folder = tmp_path / "run" / "clips"
    name = rows[0].clip_uri.rsplit("/", 1)[1]
    (folder / f"{name}.{'ab' * 16}.vlbatch-tmp").write_bytes(b"half a file")  # what a killed writer leaves
    (folder / "notes.txt.vlbatch-tmp").write_bytes(b"not ours")
    (folder / "notes.txt").write_bytes(b"the user's")
    assert clean_debris(target.folder, target.storage) == 1
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [r.clip_uri.rsplit("/", 1)[1] for r in rows] + ["notes.txt", "notes.txt.vlbatch-tmp"])
    assert clean_debris(str(tmp_path / "nowhere"), target.storage) == 0
