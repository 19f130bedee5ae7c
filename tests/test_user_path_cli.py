"""Issue 50's acceptance: the CLI driven as a user drives it, in a folder of their own.

The user's project is a temp folder: a tiny checkpoint made with `vlbatch make-tiny-checkpoint`, 14 PNGs
of which one is broken, a JSONL manifest, and `job.yaml` with paths relative to it; every command is
`python -m vlbatch.jobs.cli ...` as a subprocess run in that folder with its own HOME and no AWS
credentials, reading only its exit code and what it prints:

- a wrong `input.columns.media`: `validate` exits 2 naming the field and the columns the manifest has;
- `num_gpus: 1` with `model.device: auto` on this GPU-less machine (CUDA_VISIBLE_DEVICES empty, so even
  on a GPU host): `validate` says in one line that the model will run on the CPU;
- an s3:// output (moto's S3 server on loopback) with no credentials: `validate` exits 2, one line
  naming `output.uri` and the cause;
- the 14-media trial with the broken file: exit 0, the final line says all rows were written (it joins the
  session's Ray, tests/conftest.py: the one a run starts on its own is tests/test_run_nothing_to_do.py's);
- the same command again, with no RAY_ADDRESS (a run that starts Ray starts a new local one): "nothing to
  do", exit 0, and no Ray session folder under its Ray temp dir (RAY_TMPDIR, a folder of the test's): no
  Ray was started. One finished run serves both checks.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_jobs_support import TEST_ENV

N_MEDIA = 14
BROKEN = "img07.png"
AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The user's folder: (folder, env of its commands). The checkpoint made by the CLI, as the README says."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("user")
    env = {k: v for k, v in os.environ.items() if k not in AWS and k != "RAY_ADDRESS"}
    env.update(TEST_ENV, HOME=str(root / "home"), CUDA_VISIBLE_DEVICES="",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent/credentials", AWS_CONFIG_FILE="/nonexistent/config",
               AWS_EC2_METADATA_DISABLED="true")
    made = cli(root, env, "make-tiny-checkpoint", "ckpt")
    assert made.returncode == 0, made.stderr
    (root / "media").mkdir()
    lines = []
    for i in range(N_MEDIA):
        path = root / "media" / f"img{i:02d}.png"
        Image.fromarray((np.random.default_rng(i).random((40, 48, 3)) * 255).astype("uint8")).save(path)
        lines.append(json.dumps({"media_uri": str(path), "media_type": "image"}) + "\n")
    (root / "media" / BROKEN).write_bytes(b"this is not a png")
    (root / "manifest.jsonl").write_text("".join(lines))
    (root / "job.yaml").write_text("""model: {path: ckpt, dtype: float32, device: cpu}
input: {uri: manifest.jsonl, format: jsonl}
task: {prompt: Describe.}
sampling: {max_tokens: 4}
image: {max_pixels: 12544}
resources:
  decode: {num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}
  preprocess: {num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}
  model: {num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}
  write: {num_cpus: 0.25, batch_size: 4}
output: {uri: out, run_id: trial}
""")
    return root, env


def cli(cwd: Path, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.slow
def test_validate_refuses_a_media_column_the_manifest_does_not_have(project):
    root, env = project
    got = cli(root, env, "validate", "job.yaml", "--set", "input.columns.media=image_path")
    assert got.returncode == 2, got.stdout + got.stderr
    err = got.stderr.strip()
    assert "input.columns.media" in err and "'image_path'" in err, err
    assert "columns are: media_uri, media_type" in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_validate_on_a_gpu_less_machine_says_the_model_runs_on_the_cpu(project):
    root, env = project
    got = cli(root, env, "validate", "job.yaml", "--set", "resources.model.num_gpus=1", "--set", "model.device=auto")
    assert got.returncode == 0, got.stdout + got.stderr
    said = [line for line in got.stdout.splitlines() if "the model will run on the CPU" in line]
    assert len(said) == 1 and "no GPU here" in said[0] and "resources.model.num_gpus=1" in said[0], got.stdout


@pytest.mark.slow
def test_validate_an_s3_output_without_credentials_is_exit_2_naming_output_uri(project, s3_server):
    root, env = project
    got = cli(root, env, "validate", "job.yaml", "--set", "output.uri=s3://user-path-out/runs",
              "--set", f"storage.endpoint_url={s3_server.endpoint_url}", "--set", "storage.retries=1")
    assert got.returncode == 2, got.stdout + got.stderr
    err = got.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vlbatch: output.uri: "), err
    assert "credentials" in err.lower(), err


@pytest.mark.ray
def test_a_trial_with_one_broken_file_succeeds_and_the_rerun_starts_no_ray(project, ray_cluster):
    root, env = project
    ray_tmp = Path(tempfile.mkdtemp(prefix="vlbu-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        _trial_and_rerun(root, dict(env, RAY_TMPDIR=str(ray_tmp)), ray_tmp, ray_cluster.address)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _trial_and_rerun(root: Path, env: dict, ray_tmp: Path, address: str) -> None:
    run = cli(root, dict(env, RAY_ADDRESS=address), "run", "job.yaml", "--no-lock")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    last = run.stdout.splitlines()[-1]
    assert f"done: {N_MEDIA - 1} ok, 1 error" in last and "all rows written" in last, last
    assert f"[vlbatch] ray: {address}" in run.stdout.splitlines(), run.stdout  # the session's Ray, joined
    sessions = sorted(p.name for p in ray_tmp.rglob("session_*"))
    assert sessions == [], list(ray_tmp.rglob("*"))  # none of its own under the test's temp dir

    again = cli(root, env, "run", "job.yaml", "--no-lock")  # no RAY_ADDRESS: Ray started would be a local one
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert again.stdout.splitlines()[-1].startswith(f"[vlbatch] nothing to do: all {N_MEDIA} requests of "), \
        again.stdout
    assert "starting Ray" not in again.stdout, again.stdout
    assert sorted(p.name for p in ray_tmp.rglob("session_*")) == sessions  # no Ray session was started
