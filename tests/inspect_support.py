"""Test support for `vlbatch inspect`: a run directory made through the real sink, with real media of
every kind the page previews, and real headless Chromium.

`make_run` commits rows through `ParquetSink` (two part files) and writes `_summary.json` from a
`RunSummary` whose timeline a `Timeline` built from the same rows (a controlled clock: the
arrival times are the test's). The rows: ok rows for an image (caption), an image asked two
questions (the second an `EngineError`), an H.264 video, two WebDataset members of a tar shard,
an embedded-bytes Parquet row and an http:// image on a loopback server; error rows of every
error type a row can hold (MediaError x2, MediaTimeoutError, InputError with a null media_uri,
StorageError, EngineError). `corrupt.jpg`, `zero.png` and `gone.png` cannot be previewed.
"""
from __future__ import annotations

import hashlib
import io
import re
import shutil
import subprocess
import tarfile
import threading
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OutputRow, rows_to_table
from vlbatch.operators.storage import DEFAULT_STORAGE, StorageOptions
from vlbatch.pipeline.telemetry.summary import RunSummary
from vlbatch.pipeline.telemetry.timeline import Timeline

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "out" / "test-artifacts"  # git-ignored (/out/): screenshots kept after the test
RUN_ID = "inspect-test"
MODEL = "tiny-model"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def image_bytes(color: tuple[int, int, int], size=(320, 200), fmt="PNG") -> bytes:
    """A solid `color` image with a white square (so a thumbnail has content), encoded."""
    a = np.zeros((size[1], size[0], 3), np.uint8)
    a[:] = color
    a[size[1] // 4: size[1] // 2, size[0] // 4: size[0] // 2] = 255
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format=fmt)
    return buf.getvalue()


def write_media(media: Path) -> None:
    """The local media files (module docstring) under `media`."""
    from vlbatch.devtools.samples import encode_video

    media.mkdir(parents=True, exist_ok=True)
    (media / "red.png").write_bytes(image_bytes((220, 30, 30)))
    (media / "photo.jpg").write_bytes(image_bytes((30, 60, 220), fmt="JPEG"))
    (media / "web.png").write_bytes(image_bytes((240, 200, 20)))
    encode_video(media / "clip.mp4", 30, 160, 96, 10.0)  # 3 s at 10 fps: 6 frames at 2 fps
    shutil.copy(media / "clip.mp4", media / "slow.mp4")
    (media / "corrupt.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg" * 4)
    (media / "zero.png").write_bytes(b"")
    with tarfile.open(media / "data-000.tar", "w") as tar:
        for name, data in (("s000.jpg", image_bytes((30, 160, 60), fmt="JPEG")), ("s000.txt", b"a caption"),
                           ("s001.png", image_bytes((150, 40, 170)))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pq.write_table(pa.table({"image": pa.array([image_bytes((10 * i, 90, 90)) for i in range(3)], pa.binary()),
                             "n": [0, 1, 2]}), media / "emb.parquet", row_group_size=2)
    return {"media": media}


def rows_for(media: str, web: str) -> list[OutputRow]:
    """The run's rows (module docstring); `media`: the folder's URI, `web`: the http image's URL."""
    def ok(uri, kind, answer, prompt="Describe this image.", idx=0, toks=(40, 36, 12)):
        return OutputRow(id=_id(uri, idx), request_index=idx, media_uri=uri, media_type=kind, prompt=prompt,
                         status="ok", model=MODEL, run_id=RUN_ID, answer=answer, prompt_tokens=toks[0],
                         visual_tokens=toks[1], generated_tokens=toks[2], finish_reason="stop")

    def err(uri, kind, et, msg, idx=0):
        return OutputRow(id=_id(uri, idx), request_index=idx, media_uri=uri, media_type=kind,
                         prompt="Describe this image.", status="error", model=MODEL, run_id=RUN_ID, error_type=et,
                         error_message=msg)

    return [
        ok(f"{media}/red.png", "image", "A red picture with a white square.", toks=(52, 36, 9)),
        ok(f"{media}/photo.jpg", "image", "Blue.", prompt="What colour is it?", toks=(20, 36, 2)),
        err(f"{media}/photo.jpg", "image", "EngineError", "the model actor died (restarted)", idx=1),
        ok(f"{media}/clip.mp4", "video", "A square moves.", prompt="Describe this video.", toks=(150, 120, 5)),
        ok(f"{media}/data-000.tar#s000.jpg", "image", "A green picture.", toks=(52, 36, 5)),
        ok(f"{media}/data-000.tar#s001.png", "image", "A purple picture.", toks=(52, 36, 5)),
        ok(f"{media}/emb.parquet#2", "image", "A teal picture.", toks=(52, 36, 5)),
        ok(web, "image", "A yellow picture.", toks=(52, 36, 130)),
        err(f"{media}/corrupt.jpg", "image", "MediaError", "image data is truncated or corrupt"),
        err(f"{media}/zero.png", "image", "MediaError", "the image file is empty (0 bytes)"),
        err(f"{media}/slow.mp4", "video", "MediaTimeoutError", "decoding took longer than 60 s"),
        err(None, "image", "InputError", "the manifest's media_uri is null"),
        err(f"{media}/gone.png", "image", "StorageError", "reading gone.png failed: connection reset"),
    ]


def _id(uri: str | None, idx: int) -> str:
    return hashlib.sha256(f"{uri}#{idx}".encode()).hexdigest()[:32]


def make_run(run_uri: str, rows: list[OutputRow], storage: StorageOptions = DEFAULT_STORAGE) -> pa.Table:
    """Commit `rows` as two part files and the summary (with its timeline) under `run_uri`; the whole table."""
    sink = ParquetSink(run_uri, storage)
    sink.prepare()
    now = [0.0]
    timeline = Timeline(clock=lambda: now[0])
    half = len(rows) // 2
    for at, chunk in ((2.5, rows[:half]), (6.5, rows[half:])):
        table = rows_to_table(chunk)
        sink.commit(table)
        now[0] = at
        timeline.update(table)
    summary = RunSummary(run_id=RUN_ID, output_dir=run_uri, requests_pending=len(rows), requests_skipped=0,
                         processed_by_status={"ok": 7, "error": 6}, elapsed_s=7.0, rows_per_s=len(rows) / 7.0,
                         time_to_first_row_s=2.5, timeline=timeline.to_json())
    sink.write_summary(summary.to_json())
    sink.finish()  # as the runner does: the empty _tmp/ goes
    return rows_to_table(rows)


@dataclass
class StaticServer:
    """A loopback HTTP server for a folder (http(s) media)."""

    root: Path

    def __enter__(self) -> StaticServer:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(self.root)))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def chromium(page: Path, shot: Path, profile: Path, *, width: int = 1280, height: int = 2400) -> str:
    """Open `page` in headless Chromium (Debian's `chromium`, .ci/run installs it): a screenshot to
    `shot`, and the DOM after the load event (returned)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "headless Chromium is needed: apt-get install -y chromium (.ci/run does)"
    flags = [exe, *CHROMIUM_FLAGS, f"--window-size={width},{height}"]
    url = page.resolve().as_uri()
    for what, extra in (("screenshot", [f"--screenshot={shot}"]), ("dom", ["--dump-dom"])):
        profile_dir = profile / what  # a new empty profile each time
        profile_dir.mkdir(parents=True)
        run = subprocess.run([*flags, f"--user-data-dir={profile_dir}", *extra, url], capture_output=True,
                             text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def section(dom: str, ident: str) -> str:
    """The markup of `<section id=ident>` in a dumped DOM."""
    m = re.search(rf'<section id="{ident}"[^>]*>(.*?)</section>', dom, re.S)
    assert m, f"no section #{ident}"
    return m.group(1)


def cards(dom: str) -> list[str]:
    """The markup of each `#sample .card` (cards are siblings: split on their opening tags)."""
    body = section(dom, "sample")
    return [c for c in re.split(r'(?=<div class="card[ "])', body) if c.startswith('<div class="card')]
