"""Error messages are stable and meaningful: no per-run object addresses reach an output row.

The bad sample files (`vlbatch.devtools.samples.write_all`) are loaded through `load_media`
here and in a second process (other addresses): the messages carry no `0x...` address and
read the same both times. The last-line sanitiser where error rows are made
(`MediaTask.failed`, the model stage's per-request messages) removes any that slip through.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from vlbatch.operators.errors import MediaError, stable_message
from vlbatch.pipeline.stages.model_stage import ModelStage
from vlbatch.pipeline.stages.rows import MediaTask, Prepared

ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")

MESSAGES = r"""
import json, sys
from vlbatch.operators.media.load import load_media
out = {}
for path in json.loads(sys.argv[1]):
    for backend in ("decord", "pyav"):
        try:
            load_media(path, backend=backend)
            out[path + "|" + backend] = None
        except Exception as e:
            out[path + "|" + backend] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    from vlbatch.devtools.samples import write_all

    manifest = write_all(tmp_path_factory.mktemp("samples"))
    paths = [item["path"] for kind in ("images", "videos") for item in manifest[kind] if item["bad"]]
    assert any(p.endswith("not_image.png") for p in paths)  # the file whose PIL error named a BytesIO
    return paths


def _messages(paths: list[str]) -> dict[str, str | None]:
    done = subprocess.run([sys.executable, "-c", MESSAGES, json.dumps(paths)], check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bad_files_give_stable_messages_without_addresses(bad_files):
    first, second = _messages(bad_files), _messages(bad_files)
    assert set(first) == {f"{p}|{b}" for p in bad_files for b in ("decord", "pyav")}
    for key, msg in first.items():
        assert msg is not None and msg.startswith("MediaError: "), (key, msg)
        assert not ADDRESS.search(msg), (key, msg)
        assert "<none>" not in msg and "Errno" not in msg, (key, msg)  # FFmpeg's in-memory file name, errno
        assert msg == second[key], (key, msg, second[key])


def test_unidentified_image_names_its_size_not_its_bytes():
    from vlbatch.operators.media.image import load_image

    with pytest.raises(MediaError, match=r"^bytes are not a decodable image \(13 bytes\): no image format") as e:
        load_image(b"<html></html>")
    assert "3c68746d6c3e" not in str(e.value)  # issue 48 item 5: never the file's contents


def test_sanitiser_drops_object_addresses():
    text = "cannot identify image file <_io.BytesIO object at 0x7f1d2c3b4a50>; again <Foo at 0xDEADBEEF>"
    assert stable_message(text) == "cannot identify image file <_io.BytesIO object>; again <Foo>"
    assert stable_message("plain 0x10 flag") == "plain 0x10 flag"  # only ' at 0x...' object reprs
    assert stable_message(None) is None
    assert len(stable_message("x" * 5000)) == 2000


def test_error_rows_carry_no_address():
    err = OSError(f"cannot identify image file {object()!r}")
    row = MediaTask(media_uri="a.png", media_type="image", ids=("r",), request_indices=(0,), prompts=("p",))
    failed = row.failed(err)
    assert failed.status == "error" and failed.error_type == "OSError"
    assert failed.error_message == "cannot identify image file <object object>"
    # the model stage's per-request messages (engine errors, backend InputErrors, whole-batch failures)
    prepared = Prepared(media_uri="a.png", media_type="image", ids=("r",), request_indices=(0,), prompts=("p",))
    from vlbatch.operators.engine.request import Result, Timings
    from vlbatch.operators.errors import EngineError

    out = Result("r", (), "", None, "error", 3, 0, 0, 0, Timings(0.0, 0.0, 0.0), error=f"RuntimeError: {object()!r} died",
                 error_type="EngineError")
    stage = ModelStage.__new__(ModelStage)
    g = ModelStage._generated(stage, prepared, [out], 0.0)
    assert g.req_error_messages == ("RuntimeError: <object object> died",)
    g = ModelStage._generated(stage, prepared, [EngineError(f"batch failed: {object()!r}")], 0.0)
    assert g.req_error_messages == ("batch failed: <object object>",) and g.statuses == ("error",)


def test_config_error_names_a_type_not_an_object():
    from vlbatch.operators.errors import ConfigError
    from vlbatch.operators.media.load import load_media

    with pytest.raises(ConfigError, match=r"got object$"):
        load_media("a.png", media_type=object())
    with pytest.raises(ConfigError, match=r"got 'audio'$"):
        load_media("a.png", media_type="audio")
