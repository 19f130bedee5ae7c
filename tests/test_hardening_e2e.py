"""Acceptance of the hardening issue: one manifest with every kind of bad or odd input we know of,
through `run_job` on a real local Ray (the session's, tests/conftest.py: started by this process), with the
tiny checkpoint.

It must give exactly one output row per distinct request (duplicates dropped), the expected
status and typed error for each kind, no hang (the test has a time limit), and a bounded peak
RSS in every process of the run: this test's process tree is sampled while the job runs (Ray's
raylet, workers and the decoder children are its descendants) and each process's peak
(`VmHWM`) must stay under `RSS_BOUND`.
"""
from __future__ import annotations

import json
import os
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]

RSS_BOUND = 2 << 30  # bytes, per process: the tiny model, a worker's imports, one bounded media at a time
MAX_BYTES = 8 << 20  # image.max_bytes / video.max_bytes of the job


def _bomb_png(path: Path, side: int) -> None:
    """A valid grayscale PNG of side x side zero pixels, a few KB on disk (IDAT compressed by zlib)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    comp, line = zlib.compressobj(9), b"\x00" + bytes(side)  # filter byte + one row of zeros
    raw = b"".join(comp.compress(line) for _ in range(side)) + comp.flush()
    ihdr = side.to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


def _media(root: Path) -> list[tuple[dict, str, str | None]]:
    """[(manifest row, expected status, expected error_type)]: each a kind of input."""
    from vlbatch.devtools.samples import write_all

    samples = write_all(root / "samples")
    by_name = {Path(x["path"]).name: x["path"] for x in samples["images"] + samples["videos"]}
    good_img = next(x["path"] for x in samples["images"] if not x["bad"])
    good_vid = next(x["path"] for x in samples["videos"] if not x["bad"] and x["path"].endswith(".mp4"))
    odd = root / "odd"
    odd.mkdir()
    (odd / "loop_a.jpg").symlink_to(odd / "loop_b.jpg")
    (odd / "loop_b.jpg").symlink_to(odd / "loop_a.jpg")
    os.mkfifo(odd / "fifo.jpg")
    with open(odd / "sparse_3g.jpg", "wb") as f:
        f.truncate(3 << 30)
    _bomb_png(odd / "bomb_14000.png", 14000)  # 196 Mpx: over the decoder's pixel limit
    Image.fromarray(np.zeros((1, 400, 3), np.uint8)).save(odd / "aspect_400x1.png")
    Image.fromarray(np.full((1, 1, 3), 200, np.uint8)).save(odd / "one_pixel.png")
    (odd / "png_named.jpg").write_bytes(Path(by_name["rgb_640x480.png"] if "rgb_640x480.png" in by_name
                                             else good_img).read_bytes())
    (odd / "image_as_video.mp4").write_bytes(Path(good_img).read_bytes())
    (odd / "dir.jpg").mkdir()
    (odd / "unreadable.jpg").write_bytes(Path(good_img).read_bytes())
    (odd / "unreadable.jpg").chmod(0)
    E = "error"
    kinds = [
        ({"media_uri": good_img}, "ok", None),
        ({"media_uri": good_img}, "dropped", None),  # an identical row: the same requests, run once
        ({"media_uri": good_vid}, "ok", None),
        ({"media_uri": by_name["claims_more.mp4"]}, "ok", None),  # header lies: decoders clamp
        ({"media_uri": str(odd / "png_named.jpg")}, "ok", None),  # PNG bytes under .jpg
        ({"media_uri": str(odd / "one_pixel.png")}, "ok", None),
        ({"media_uri": good_img, "qs": ["What is it?", "What colour?"]}, "ok", None),  # questions: 2 rows
        ({"media_uri": by_name["truncated.jpg"]}, E, "MediaError"),
        ({"media_uri": by_name["zero.png"]}, E, "MediaError"),
        ({"media_uri": by_name["not_image.png"]}, E, "MediaError"),
        ({"media_uri": by_name["truncated.mp4"]}, E, "MediaError"),
        ({"media_uri": by_name["zero.mp4"]}, E, "MediaError"),
        ({"media_uri": by_name["not_media.mp4"]}, E, "MediaError"),
        ({"media_uri": by_name["garbage.webm"]}, E, "MediaError"),
        ({"media_uri": by_name["audio_only.m4a"]}, E, "InputError"),
        ({"media_uri": str(odd / "loop_a.jpg")}, E, "MediaError"),
        ({"media_uri": str(odd / "fifo.jpg")}, E, "MediaError"),
        ({"media_uri": "/dev/zero"}, E, None),  # no extension, not a regular file: refused either way
        ({"media_uri": str(odd / "sparse_3g.jpg")}, E, "InputError"),  # over max_bytes, checked before reading
        ({"media_uri": str(odd / "bomb_14000.png")}, E, "MediaError"),
        ({"media_uri": str(odd / "aspect_400x1.png")}, E, "InputError"),
        ({"media_uri": str(odd / "image_as_video.mp4")}, E, "MediaError"),
        ({"media_uri": str(odd / "dir.jpg")}, E, "MediaError"),
        ({"media_uri": str(odd / "missing.jpg")}, E, "MediaError"),
        ({"media_uri": None}, E, "InputError"),
        ({"media_uri": ""}, E, "InputError"),
        ({"media_uri": "gs://bucket/x.jpg"}, E, None),  # a scheme we do not read
        ({"media_uri": str(odd / "notes.txt")}, E, None),  # does not exist and has no media extension
    ]
    if os.geteuid() != 0:  # root reads mode-0 files anyway
        kinds.append(({"media_uri": str(odd / "unreadable.jpg")}, E, "MediaError"))
    return kinds


class PeakRss:
    """Samples VmHWM (peak RSS) of every descendant of this process until stopped."""

    def __init__(self):
        self.peaks: dict[int, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self):
        parent: dict[int, int] = {}
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                    parent[int(p.name)] = int(fields[1])
                except (OSError, IndexError, ValueError):
                    continue
        me, mine = os.getpid(), set()
        own = Path(f"/proc/{me}/cmdline").read_bytes()
        for pid in parent:
            q, seen = pid, 0
            while q in parent and q != me and seen < 64:
                q, seen = parent[q], seen + 1
            if q == me:
                mine.add(pid)
        for pid in mine:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if cmd == own:  # forked from this process, not yet exec'd: its VmHWM is this process's
                continue
            name = cmd.replace(b"\0", b" ")[:80].decode(errors="replace")
            hwm = next((int(ln.split()[1]) << 10 for ln in status.splitlines() if ln.startswith("VmHWM")), 0)
            if hwm > self.peaks.get(pid, (0, ""))[0]:
                self.peaks[pid] = (hwm, name)


def _expected_rows(kinds, request_id, manifest) -> dict:
    """request id -> (media_uri, status, error type) for every request the manifest's kept rows ask;
    a line with no media value is named by its line (`<manifest>#L<n>`), each its own request."""
    expected = {}
    for line, (row, status, etype) in enumerate(kinds, start=1):
        if status == "dropped":
            continue
        identity = row["media_uri"] if row["media_uri"] else f"{manifest}#L{line}"
        for k, q in enumerate(row.get("qs") or ["Describe."]):
            rid = request_id(identity, k, q)
            assert rid not in expected
            expected[rid] = (row["media_uri"], status, etype)
    return expected


def test_every_kind_of_bad_input_in_one_manifest(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job
    from vlbatch.pipeline.stages.requests import request_id

    kinds = _media(tmp_path)
    assert len({json.dumps(k[0], sort_keys=True) for k in kinds}) >= 25  # distinct kinds of input
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(k[0]) + "\n" for k in kinds))
    cfg = validate_config({
        "model": {"path": str(tiny_ckpt("dense")), "device": "cpu", "dtype": "float32",
                  "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 1024}},
        "input": {"uri": str(manifest), "format": "jsonl", "columns": {"questions": "qs"}},
        "task": {"mode": "questions", "questions": ["Describe."]},
        "sampling": {"max_tokens": 4},
        "image": {"max_pixels": 65536, "max_bytes": MAX_BYTES},
        "video": {"fps": 2.0, "max_frames": 8, "max_pixels": 16384, "decode_timeout_s": 30, "max_bytes": MAX_BYTES},
        "resources": {"preprocess": {"num_cpus": 0.5, "batch_size": 4, "max_actors": 1},
                      "model": {"num_cpus": 1, "batch_size": 4}, "write": {"num_cpus": 0.25, "batch_size": 8}},
        "output": {"uri": str(tmp_path / "out"), "run_id": "bad"},
        "max_error_fraction": 1.0,
    })
    with PeakRss() as rss:  # the session's Ray (2 CPUs): its raylet and workers are this process's descendants
        summary = run_job(cfg)
        rss.sample()
    from vlbatch.operators.sink.parquet import ParquetSink

    rows = ParquetSink(str(tmp_path / "out" / "bad")).read().to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a request was written twice"
    expected = _expected_rows(kinds, request_id, manifest)
    assert sorted(ids) == sorted(expected)  # exactly one row per distinct request
    for r in rows:
        uri, status, etype = expected[r["id"]]
        assert r["media_uri"] == uri  # the original value, never a rewritten path
        assert r["status"] == status, (uri, r["error_type"], r["error_message"])
        if status == "error":
            assert r["error_type"] in ("MediaError", "InputError", "ConfigError"), (uri, r["error_type"])
            assert etype is None or r["error_type"] == etype, (uri, r["error_type"], r["error_message"])
            assert r["error_message"] and " at 0x" not in r["error_message"], (uri, r["error_message"])
        else:
            assert r["answer"] is not None and r["error_type"] is None
    assert summary.duplicates_dropped == 1
    worst = max(rss.peaks.values())
    assert worst[0] < RSS_BOUND, f"peak RSS {worst[0] >> 20} MiB in {worst[1]!r}"
    assert len(rss.peaks) >= 3  # the sampler saw the run's processes (raylet, workers), not just itself
