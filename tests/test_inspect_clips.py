"""`vlbatch inspect` on a clipped run (issue 51): a video's clips as a timeline, in the terminal (one
line per clip: index, start-end, source, caption) and in the HTML page (a strip: per clip a frame near
its middle, its start-end and caption). Rows are built in the output schema and committed through the
real Parquet sink (inspect reads only the output), about a real encoded video with hard cuts at known
frames (`test_clips.CUTS`): each clip's frame must show its own scene's colour."""
from __future__ import annotations

import base64
import io
import re

import numpy as np
import pyarrow as pa
from PIL import Image
from test_clips import COLOURS, CUTS, FPS, _video

from vlbatch.jobs.inspect.text import run_inspect
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA

BOUNDS = (0, *CUTS, 90)  # frames: scene k is [BOUNDS[k], BOUNDS[k + 1])


def _rows(video: str, other: str, image: str) -> list[dict]:
    base = {"status": "ok", "run_id": "r", "media_type": "video", "model": "m", "visual_tokens": 16}
    rows = []
    for k in range(4):  # two prompts per clip: the caption (request 0) is the clip's caption
        clip = {"media_uri": video, "clip_index": k, "clip_start_s": BOUNDS[k] / FPS, "clip_end_s": BOUNDS[k + 1] / FPS,
                "clip_source": "scenes", "clip_last": k == 3}
        rows.append({**base, **clip, "id": f"v{k}a", "request_index": 0, "prompt": "Describe.",
                     "answer": f"scene {k} caption"})
        rows.append({**base, **clip, "id": f"v{k}b", "request_index": 1, "prompt": "Colour?", "answer": f"colour {k}"})
    for k in range(2):  # a second video, interrupted: its last clip not committed, one clip failed
        clip = {"media_uri": other, "clip_index": k, "clip_start_s": 2.0 * k, "clip_end_s": 2.0 * k + 2,
                "clip_source": "fixed", "clip_last": False}
        bad = {"status": "error", "error_type": "InputError", "error_message": "too many bytes"} if k else {}
        rows.append({**base, **clip, "id": f"o{k}", "request_index": 0, "prompt": "Describe.",
                     "answer": None if k else "first window", **bad})
    rows.append({**base, "media_type": "image", "media_uri": image, "id": "i", "request_index": 0,
                 "prompt": "Describe.", "answer": "an image"})
    return rows


def _commit(run_dir, rows: list[dict]) -> None:
    table = pa.table({f.name: pa.array([r.get(f.name) for r in rows], f.type) for f in OUTPUT_SCHEMA},
                     schema=OUTPUT_SCHEMA)
    sink = ParquetSink(str(run_dir))
    sink.prepare()
    sink.commit(table.slice(0, 5))
    sink.commit(table.slice(5))  # a video's rows over two parts


def test_inspect_shows_each_clipped_video_as_a_timeline(tmp_path):
    _video(tmp_path, 90)
    video, other, image = str(tmp_path / "scenes.mp4"), str(tmp_path / "gone.mp4"), str(tmp_path / "i.png")
    run_dir = tmp_path / "out" / "r"
    _commit(run_dir, _rows(video, other, image))
    out, page = io.StringIO(), tmp_path / "report.html"
    assert run_inspect(str(run_dir), sample=0, out=out, html=str(page)) == 0
    text = out.getvalue()
    i = text.index("clips: the first 2 videos with clip rows, by URI")
    lines = text[i:].splitlines()
    assert lines[1] == f"  {other}: 2 clips (last clip not committed), 32 visual tokens"
    assert lines[2] == f"    {0:>4}  {'0.00-2.00 s':>17}  fixed   first window"
    assert lines[3] == f"    {1:>4}  {'2.00-4.00 s':>17}  fixed   InputError: too many bytes"
    assert lines[4] == f"  {video}: 4 clips (complete), 64 visual tokens"
    want = [f"    {k:>4}  {f'{BOUNDS[k] / FPS:.2f}-{BOUNDS[k + 1] / FPS:.2f} s':>17}  scenes  scene {k} caption"
            for k in range(4)]
    assert lines[5:9] == want, lines[5:9]

    html = page.read_text()
    section = html[html.index('<section id="clips">'):]
    panels = section.split('<div class="panel">')[1:]
    assert len(panels) == 2 and other in panels[0] and video in panels[1]
    assert panels[0].count('<figure class="clip">') == 2 and "placeholder" in panels[0]  # the file is gone
    figs = panels[1].split('<figure class="clip">')[1:]
    assert len(figs) == 4
    for k, fig in enumerate(figs):
        assert f"#{k}</b> {BOUNDS[k] / FPS:.2f}-{BOUNDS[k + 1] / FPS:.2f} s" in fig and f"scene {k} caption" in fig
        (b64,) = re.findall(r'class="thumb" src="data:image/jpeg;base64,([^"]+)"', fig)
        rgb = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), float)
        corner = rgb[: rgb.shape[0] // 4, : rgb.shape[1] // 4].reshape(-1, 3).mean(0)  # the background
        assert np.abs(corner - COLOURS[k]).max() < 40, (k, corner)  # a frame of this clip's own scene


def test_a_one_clip_video_says_1_clip_in_the_terminal_and_the_page():
    """Issue 60 item 13: "1 clips"."""
    from vlbatch.jobs.inspect.clips import ClipLine, VideoTimeline, print_timelines
    from vlbatch.jobs.inspect.html import _timelines

    one = VideoTimeline("v.mp4", (ClipLine(0, 0.0, 2.0, "fixed", "ok", "a square", 16),), 1, True, 16)
    out = io.StringIO()
    print_timelines([one], out.write, lambda text, n=100: text)
    assert "  v.mp4: 1 clip (complete), 16 visual tokens\n" in out.getvalue(), out.getvalue()
    assert '<div class="meta">1 clip (complete), 16 visual tokens</div>' in _timelines([one], {})
