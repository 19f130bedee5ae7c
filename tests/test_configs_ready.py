"""The ready configs (configs/*.yaml and the job configs in infra/) cannot rot: each validates
against the schema and passes the start-up path checks with only its model path and input
swapped for tiny ones (a tiny checkpoint of the same kind, a tiny input in the config's own
format and columns), everything else as shipped; the real-model ones mark the lines a user must
edit; the single-GPU ones fit the KubeRay cluster; and the Qwen3.5-9B captions config runs end
to end on a tiny checkpoint through `vlbatch run`, joining the session's Ray (2 CPUs).

For that run, besides model and input, the output goes to a temp folder and what cannot exist on
a CPU-only CI machine is scaled down: no GPU (resources.model.num_gpus 0), actors and CPUs that
fit 2 cores, and the KV pool given in MB instead of sized by memory_fraction (on the CPU that
would be a share of the host's RAM). Task, sampling, image settings, dtype and the other engine
settings (static decode, batch sizes) are the config's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_infra_manifests import check_cluster_fits_job
from test_jobs_support import TEST_ENV

from vlbatch.pipeline.config import load_config
from vlbatch.pipeline.plan.checks import check_paths

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_MARK = "# yaml-language-server: $schema="
VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".mov")


def job_configs() -> list[Path]:
    """Every YAML under configs/ and infra/ whose first line points editors at job.schema.json."""
    found = sorted(p for d in ("configs", "infra") for p in (ROOT / d).rglob("*.yaml"))
    return [p for p in found if p.read_text().splitlines()[0].startswith(SCHEMA_MARK)
            and p.read_text().splitlines()[0].endswith("job.schema.json")]


CONFIGS = job_configs()
REAL = [p for p in CONFIGS if p.parent.name == "configs" and p.name != "demo.yaml"]


def _id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_every_yaml_there_is_a_job_config_or_a_cluster_manifest():
    assert {p.name for p in REAL} >= {"qwen3.5-9b-captions.yaml", "qwen3.5-9b-video-qa.yaml", "qwen3.5-27b-tp2.yaml",
                                       "qwen3.5-35b-a3b-ep.yaml", "scan-preflight.yaml"}
    assert set((ROOT / "configs").glob("*.yaml")) <= set(CONFIGS)
    for p in set((ROOT / "infra").rglob("*.yaml")) - set(CONFIGS):
        doc = yaml.safe_load(p.read_text())
        assert "apiVersion" in doc or "cluster_name" in doc, f"{p}: neither a job config nor a cluster manifest"


def tiny_input(root: Path, section: dict) -> str:
    """A tiny input in the format and columns of a config's `input` section (videos if its URI
    names video files, else images) -> the URI to swap in."""
    import numpy as np
    from PIL import Image

    from vlbatch.devtools.samples import encode_video

    fmt, uri = section.get("format", "parquet"), section["uri"]
    column = section.get("columns", {}).get("media", "media_uri")
    media = root / "media"
    media.mkdir(parents=True)
    if uri.endswith(VIDEO_SUFFIXES):
        files = [media / "clip0.mp4"]
        encode_video(files[0], 8, 64, 48, 4.0)
    else:
        files = [media / f"img{i}.png" for i in range(2)]
        for i, f in enumerate(files):
            Image.fromarray(np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(f)
    if fmt == "glob":
        return str(media / f"*{files[0].suffix}")
    rows = [{column: str(f)} for f in files]
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), root / "manifest.parquet")
    elif fmt == "jsonl":
        (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        (root / "manifest.csv").write_text(column + "\n" + "".join(f"{r[column]}\n" for r in rows))
    else:
        raise NotImplementedError(f"no tiny input for format {fmt!r}: add one here")
    return str(root / f"manifest.{fmt}")


def swapped(path: Path, root: Path, tiny_ckpt) -> tuple[list[str], object]:
    """(the overrides swapping model path and input for tiny ones, the config loaded with them)."""
    raw = yaml.safe_load(path.read_text())
    variant = "moe" if raw["model"].get("expert_parallel") or "a3b" in path.name.lower() else "dense"
    overrides = [f"model.path={tiny_ckpt(variant)}", f"input.uri={tiny_input(root, raw['input'])}"]
    return overrides, load_config(path, overrides)


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_config_validates_with_a_tiny_model_and_input(path, tmp_path, tiny_ckpt):
    _, config = swapped(path, tmp_path, tiny_ckpt)
    check_paths(config)  # the tiny model folder and input exist and hold what a run reads
    as_shipped = load_config(path)
    rest = {"model": {"path"}, "input": {"uri"}}
    assert config.model_dump(exclude=rest) == as_shipped.model_dump(exclude=rest)  # nothing else swapped


@pytest.mark.parametrize("path", REAL, ids=_id)
def test_real_model_configs_mark_what_a_user_edits(path):
    """model.path, input.uri and output.uri carry an EDIT comment, and so does the number of GPUs
    (a replica's tensor_parallel_size, or the model actors: one per GPU); a scan has no GPUs."""
    text = path.read_text()
    config = load_config(path)
    lines = {k: [ln for ln in text.splitlines() if ln.lstrip().startswith(f"{k}:")] for k in ("path", "uri")}
    assert lines["path"] and "EDIT" in lines["path"][0]
    assert len(lines["uri"]) == 2 and all("EDIT" in ln for ln in lines["uri"])  # input, output
    if config.task.mode == "scan":
        assert config.resources.model.num_gpus == 0
    elif config.model.tensor_parallel_size > 1:
        (tp,) = [ln for ln in text.splitlines() if "tensor_parallel_size:" in ln]
        assert "EDIT" in tp and "GPUs per" in tp
    else:
        assert "EDIT max_actors: the GPUs" in text


@pytest.mark.parametrize("name", ["qwen3.5-9b-captions.yaml", "qwen3.5-9b-video-qa.yaml"])
def test_single_gpu_configs_fit_the_kuberay_cluster(name):
    cluster = yaml.safe_load((ROOT / "infra" / "kuberay" / "raycluster.yaml").read_text())
    check_cluster_fits_job(cluster, load_config(ROOT / "configs" / name))


CPU_ONLY = [  # what a 2-core CI machine without a GPU has (see the module docstring)
    "resources.model.num_gpus=0", "resources.model.num_cpus=1", "resources.model.memory_gb=null",
    "resources.model.max_actors=1", "model.engine.memory_fraction=null", "model.engine.kv_cache_mb=64",
    "resources.preprocess={num_cpus: 0.5, min_actors: 1, max_actors: 1, batch_size: 8}",
    "resources.write={num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1024}",
]


@pytest.mark.slow
@pytest.mark.ray
def test_the_9b_captions_config_runs_end_to_end_on_a_tiny_checkpoint(tmp_path, tiny_ckpt):
    path = ROOT / "configs" / "qwen3.5-9b-captions.yaml"
    overrides, _ = swapped(path, tmp_path / "in", tiny_ckpt)
    out = tmp_path / "out"
    overrides += [f"output.uri={out}", *CPU_ONLY]
    config = load_config(path, overrides)
    assert (config.model.dtype, config.model.engine.static_decode) == ("bfloat16", True)  # as shipped
    env = {**os.environ, **TEST_ENV, "HOME": str(tmp_path)}  # RAY_ADDRESS kept: joins the session's Ray
    argv = [sys.executable, "-m", "vlbatch.jobs.cli", "run", str(path), "--no-lock"]
    for ov in overrides:
        argv += ["--set", ov]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: 2 ok, 0 error" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
    table = pq.read_table(out / config.resolved_run_id())
    assert table.num_rows == 2 and set(table.column("status").to_pylist()) == {"ok"}
    assert set(table.column("prompt").to_pylist()) == {"Describe this image in detail."}
    assert all(n and n > 0 for n in table.column("generated_tokens").to_pylist())
