"""The sample media generator: what it writes is what its manifest says, reproducibly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlbatch.devtools.samples import frame_index, index_pattern, write_all
from vlbatch.operators.errors import MediaError
from vlbatch.operators.media.load import load_media, media_type_of

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sample_dirs(tmp_path_factory):
    """The same set written twice: by the script (subprocess) and in process. The script runs
    on one CPU (its affinity): encoders that size their threads by the CPUs they may use
    would write other bytes there."""
    a, b = tmp_path_factory.mktemp("by_script"), tmp_path_factory.mktemp("in_process")
    one_cpu = sorted(os.sched_getaffinity(0))[:1]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_sample_media.py"), str(a)], check=True,
                   capture_output=True, preexec_fn=lambda: os.sched_setaffinity(0, one_cpu))
    write_all(b)
    return a, b


@pytest.mark.slow
def test_generation_is_byte_for_byte_reproducible(sample_dirs):
    a, b = sample_dirs
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.suffix != ".json")
    assert len(files) >= 30
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.suffix != ".json")
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_images_are_what_the_manifest_says(sample_dirs):
    manifest = json.loads((sample_dirs[0] / "manifest.json").read_text())
    modes = {i["mode"] for i in manifest["images"] if not i["bad"]}
    assert modes >= {"RGB", "RGBA", "P", "L", "LA", "CMYK", "I;16", "1"}
    formats = {i["format"] for i in manifest["images"] if not i["bad"]}
    assert formats >= {"JPEG", "PNG", "WEBP", "GIF"}
    for item in manifest["images"]:
        if item["bad"]:
            with pytest.raises(MediaError):
                load_media(item["path"])
            continue
        with Image.open(item["path"]) as im:
            assert im.mode == item["mode"] and getattr(im, "n_frames", 1) == item["frames"], item["name"]
        pixels = load_media(item["path"])
        assert pixels.shape == (item["height"], item["width"], 3) and pixels.dtype == np.uint8, item["name"]


def test_video_manifest_lists_every_case(sample_dirs):
    videos = json.loads((sample_dirs[0] / "manifest.json").read_text())["videos"]
    codecs = {v["codec"] for v in videos if v["codec"]}
    assert {"h264", "vp9", "vp8", "mpeg4"} <= codecs
    assert {v["rotation"] for v in videos} >= {0, 90, 180, 270}
    assert any(not v["constant_rate"] for v in videos)
    assert any(v["frames"] and v["frames"] % 2 for v in videos)
    assert any(v["header_frames"] and v["frames"] is None for v in videos)
    for v in videos:
        assert Path(v["path"]).exists(), v["name"]
        assert media_type_of(v["path"], b"") == "video"


@pytest.mark.parametrize("size", [(64, 48), (97, 33), (854, 480)])
def test_frame_index_pattern_round_trips(size):
    for i in (0, 1, 2, 255, 256, 1234, 40961, 65535):
        assert frame_index(index_pattern(i, *size)) == i
