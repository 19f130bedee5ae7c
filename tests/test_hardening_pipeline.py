"""Hardening of the Ray graph: a Parquet manifest on a 2-CPU local Ray with the demo's resources
(1.75 CPUs of actor pools) must finish, not hang; identical rows run once; a null media_uri is
an error row keeping null; no empty `_tmp/` is left behind.

The session's Ray (tests/conftest.py: 2 CPUs, as CI's machine). The
job runs on a thread joined with a timeout, so a hang fails the test instead of stalling it.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
# configs/demo.yaml asks a structured question and cuts videos into clips: these tests want its caption job
CAPTION_ONLY = ("task.mode=caption", "task.questions=[]", "task.caption=false", "video.clips.mode=none")


@pytest.mark.ray
def test_parquet_manifest_on_two_cpus_with_the_demo_resources(two_cpu_ray, tmp_path):
    from vlbatch.pipeline.config import load_config
    from vlbatch.pipeline.demo import BUNDLED_MODEL, write_scenes
    from vlbatch.pipeline.graph import run_job

    images = sorted(write_scenes(tmp_path / "media", n_images=3, n_videos=0))
    uris = [images[0], images[1], images[0], images[2], None]  # a duplicate and a null
    manifest = tmp_path / "manifest.parquet"
    pq.write_table(pa.table({"media_uri": pa.array(uris, pa.string()),
                             "media_type": pa.array(["image"] * 4 + [None], pa.string())}), manifest)
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        f"model.path={BUNDLED_MODEL}", f"input.uri={manifest}", "input.format=parquet",
        f"output.uri={tmp_path / 'out'}", "sampling.max_tokens=4", "max_error_fraction=1.0", *CAPTION_ONLY])
    assert cfg.resources.preprocess.num_cpus + cfg.resources.model.num_cpus + cfg.resources.write.num_cpus == 1.75

    result: dict = {}
    t = threading.Thread(target=lambda: result.update(summary=run_job(cfg)), daemon=True)
    t.start()
    t.join(timeout=420)
    assert not t.is_alive(), "the job hung (no summary within 420 s)"
    s = result["summary"]
    assert s.committed_total == 4 and s.duplicate_ids == 0 and s.duplicates_dropped == 1
    assert s.committed_by_status == {"ok": 3, "error": 1}

    from vlbatch.operators.sink.parquet import ParquetSink

    rows = ParquetSink(s.output_dir).read().to_pylist()
    err = [r for r in rows if r["status"] == "error"]
    assert len(err) == 1 and err[0]["media_uri"] is None and err[0]["error_type"] == "InputError"
    assert sorted(r["media_uri"] for r in rows if r["status"] == "ok") == images
    assert not (Path(s.output_dir) / "_tmp").exists()
