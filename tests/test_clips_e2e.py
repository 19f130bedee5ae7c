"""Video clips end to end (issue 51): `vlbatch run` with `video.clips` fixed windows writes one row
per (clip, prompt) with its clip columns; Ctrl-C mid-run and the rerun redoes no committed clip
and loses none (ids are per clip, stable across runs); a third run finds nothing to do and starts no Ray.
With `output.clip_files` each clip row's `clip_uri` names its file under `<run>/_clips/`, and the rerun
leaves the files already there as they are.

Mid-run is an event the test controls: the media come from a loopback HTTP server that holds the
image listed after the video until the test lets it go, so the first run is certainly still running
when the test, having seen two clip rows committed, sends SIGINT."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from held_http import HoldingServer
from test_clips import scenes_pattern
from test_jobs_support import REPO, TEST_ENV, read_output

FPS, SECONDS, WINDOW = 8, 16, 2.0
N_CLIPS = int(SECONDS / WINDOW)

pytestmark = pytest.mark.ray  # the runs join the session's Ray (its SIGINT with a Ray of its own: test_run_stops.py)


def _media(tmp_path):
    import numpy as np
    from PIL import Image

    from vlbatch.devtools.samples import encode_video

    media = tmp_path / "media"
    media.mkdir()
    encode_video(media / "clips.mp4", FPS * SECONDS, 64, 48, FPS, options={"g": "8"}, pattern=scenes_pattern)
    Image.fromarray((np.random.default_rng(0).random((40, 48, 3)) * 255).astype("uint8")).save(media / "hold.png")
    return media


def _job(tmp_path, tiny_ckpt, server) -> tuple:
    manifest = tmp_path / "manifest.jsonl"
    video, image = f"{server.url}/clips.mp4", f"{server.url}/hold.png"
    manifest.write_text(json.dumps({"media_uri": video, "media_type": "video"}) + "\n"
                        + json.dumps({"media_uri": image, "media_type": "image"}) + "\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {tiny_ckpt('dense')}, dtype: float32, device: cpu}}
input: {{uri: {manifest}, format: jsonl}}
task: {{mode: caption, prompt: Describe., video_prompt: "What happens?"}}
sampling: {{max_tokens: 3}}
image: {{max_pixels: 12544}}
video: {{fps: 2.0, min_frames: 2, max_frames: 4, max_pixels: 12544, clips: {{mode: fixed, window_s: {WINDOW}}}}}
resources:
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  model: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  write: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
output: {{uri: {tmp_path / 'out'}, part_rows: 1, clip_files: {{format: mp4}}}}
ray: {{progress_interval_s: 1}}
""")
    return cfg, video, image


def _start(cfg, home) -> subprocess.Popen:
    env = dict(os.environ, **TEST_ENV, HOME=str(home))  # RAY_ADDRESS kept: the run joins the session's Ray
    return subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--no-lock"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)


def _parts(out_dir, proc, n: int, deadline_s=600):
    """Wait until `n` part files are committed (the event the signal waits for)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if len(list(out_dir.glob("*/part-*.parquet"))) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before committing {n} parts: {proc.communicate()}")
        time.sleep(0.2)
    raise AssertionError("no part files committed")


def test_clip_rows_and_resume_after_sigint_redo_no_committed_clip(tmp_path, tiny_ckpt):
    from vlbatch.pipeline.stages.requests import clip_request_id, request_id

    server = HoldingServer(_media(tmp_path))
    try:
        cfg, video, image = _job(tmp_path, tiny_ckpt, server)
        out_dir, home = tmp_path / "out", tmp_path / "home"
        home.mkdir()
        proc = _start(cfg, home)
        try:
            _parts(out_dir, proc, 2)
            os.killpg(proc.pid, signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 130, stdout + stderr
        (run_dir,) = [p for p in out_dir.iterdir() if p.is_dir()]
        before = read_output(run_dir)
        n = len(before)
        assert 2 <= n <= N_CLIPS and all(r["media_uri"] == video for r in before)  # the image was held
        parts = {p.name: p.read_bytes() for p in run_dir.glob("part-*.parquet")}
        files = {r["clip_uri"]: _stat(r["clip_uri"]) for r in before}  # the committed clips' files
        assert len(files) == n and all(files.values())

        server.release.set()
        again = _start(cfg, home)
        stdout, stderr = again.communicate(timeout=600)
        assert again.returncode == 0, stdout + stderr
        m = re.search(r"done: (\d+) ok, (\d+) error", stdout)
        assert m and int(m.group(1)) == N_CLIPS + 1 - n and m.group(2) == "0", stdout  # no committed clip redone
        rows = read_output(run_dir)
        assert all((run_dir / name).read_bytes() == data for name, data in parts.items())  # kept as they were
        assert {uri: _stat(uri) for uri in files} == files  # not rewritten (same inode, same mtime)
        third = _start(cfg, home)  # complete: the last clip's rows say so, and no Ray starts (nothing_to_do.py)
        stdout, stderr = third.communicate(timeout=300)
        assert third.returncode == 0, stdout + stderr
        assert stdout.splitlines()[-1] == (f"[vlbatch] nothing to do: all {N_CLIPS + 1} requests of {run_dir}/ "
                                           "are committed") and "starting Ray" not in stdout, stdout
    finally:
        server.close()
    assert len(rows) == len({r["id"] for r in rows}) == N_CLIPS + 1 and all(r["status"] == "ok" for r in rows)
    clips = sorted((r for r in rows if r["media_uri"] == video), key=lambda r: r["clip_index"])
    base = request_id(video, 0, "What happens?")
    assert [r["id"] for r in clips] == [clip_request_id(base, k) for k in range(N_CLIPS)]  # stable, per clip
    assert [(r["clip_index"], r["clip_start_s"], r["clip_end_s"], r["clip_source"], r["clip_last"]) for r in clips] == [
        (k, k * WINDOW, (k + 1) * WINDOW, "fixed", k == N_CLIPS - 1) for k in range(N_CLIPS)]
    assert all(r["prompt"] == "What happens?" and r["media_type"] == "video" for r in clips)
    (img,) = [r for r in rows if r["media_uri"] == image]
    assert (img["clip_index"], img["clip_start_s"], img["clip_end_s"], img["clip_source"], img["clip_uri"],
            img["clip_last"]) == (None,) * 6
    uris = [r["clip_uri"] for r in clips]
    assert len(set(uris)) == N_CLIPS and all(u.startswith(f"{run_dir}/_clips/") and u.endswith(".mp4") for u in uris)
    assert sorted(p.name for p in (run_dir / "_clips").iterdir()) == sorted(u.rsplit("/", 1)[1] for u in uris)


def _stat(path: str) -> tuple[int, int] | None:
    """(inode, mtime in ns) of a file, None when it is missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns
