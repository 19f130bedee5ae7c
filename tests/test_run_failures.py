"""What fails inside Ray ends the run in one line (issue 33: "Anything that fails inside an actor's
constructor ... ends the run within seconds with one line naming the cause and the field, a
distinct exit code, and the Ray detail in the log file"; issue 31 item 6: errors of the job's own
setup fail the run and are never committed as rows). Real parts: a moto S3 server for a remote
checkpoint, a real local Ray (the session's, or the run's own where said), the real CLI."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from test_jobs_support import REPO, TEST_ENV

from vlbatch.pipeline.config import validate_config


def _cli(*args, env=None, timeout=600, local_ray=False) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: `run` joins the session's Ray (RAY_ADDRESS) unless `local_ray` (a new
    local Ray of the run's own); other commands plan for this machine (no RAY_ADDRESS)."""
    full = dict(os.environ, **TEST_ENV, **(env or {}))
    if args[:1] != ("run",) or local_ray:
        full.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=REPO)


@pytest.mark.ray
def test_an_actor_that_cannot_start_ends_the_run_in_one_line(tmp_path, tiny_ckpt, s3_server):
    """An s3:// checkpoint holding config.json and the weights but not the tokenizer: validate reads
    config.json alone (valid); the run's CPU actor downloads the checkpoint and cannot load its
    processor. One line names the stage, the field and the cause; exit 2; Ray's tracebacks go to
    the log file; no row is committed. The run starts a local Ray of its own: its actors must get the
    run's environment (the fake S3 credentials), which a new local Ray inherits and the session's Ray,
    started before this test's server, does not."""
    from PIL import Image

    ckpt = tiny_ckpt("dense")
    bucket = "h3-broken-ckpt"
    s3 = s3_server.client()
    s3.create_bucket(Bucket=bucket)
    for name in ("config.json", "model.safetensors"):
        s3.upload_file(str(ckpt / name), bucket, f"ckpt/{name}")
    media = tmp_path / "media"
    media.mkdir()
    Image.new("RGB", (32, 24), (10, 200, 30)).save(media / "a.png")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: "s3://{bucket}/ckpt", dtype: float32, device: cpu, cache_dir: {tmp_path / 'cache'}}}
input: {{uri: "{media}/*.png", format: glob}}
sampling: {{max_tokens: 4}}
storage: {{endpoint_url: "{s3_server.endpoint_url}", retries: 0}}
resources:
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1}}
  model: {{num_cpus: 0.25}}
  write: {{num_cpus: 0.25}}
output: {{uri: {tmp_path / 'out'}}}
""")
    assert _cli("validate", str(cfg), env=s3_server.env).returncode == 0
    r = _cli("run", str(cfg), "--no-lock", "--name", "h3-broken", env=s3_server.env, local_ray=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("vlbatch:")]
    assert len(ours) == 1 and r.stderr.strip().splitlines()[-1] == ours[0], r.stderr
    line = ours[0]
    assert re.search(r"the (preprocess|model) stage could not start \(model\.path=s3://h3-broken-ckpt/ckpt\)", line), line
    assert "tokenizer.json" in line or "chat template" in line or "tokenizer" in line, line
    log = re.search(r"details: (\S+)$", line).group(1)
    assert re.search(r"/vlbatch/runs/run-[0-9a-f]{12}/error\.log$", log), log  # the run's own folder (issue 50)
    assert "Traceback (most recent call last)" in open(log).read()  # the detail: in the file, not on the terminal
    assert not list((tmp_path / "out").glob("*/part-*.parquet"))  # nothing committed


def test_a_setup_error_is_never_an_error_row(tmp_path, tiny_ckpt):
    """A checkpoint without a chat template: the CPU stage does not start (SetupError), and one
    that loses its template later fails the call instead of writing a permanent InputError row."""
    import shutil

    from vlbatch.operators.errors import SetupError
    from vlbatch.pipeline.stages.preprocess import PreprocessStage
    from vlbatch.pipeline.stages.rows import Decoded

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("dense"), ckpt)
    cfg = validate_config({"model": {"path": str(ckpt), "device": "cpu"}, "input": {"uri": "x"},
                           "output": {"uri": str(tmp_path / "out")}})
    stage = PreprocessStage(cfg)
    row = Decoded(media_uri="a.png", media_type="image", ids=("r0",), request_indices=(0,), prompts=("Describe.",),
                  frames=np.zeros((1, 32, 32, 3), np.uint8))
    assert stage.prepare_one(row).status == "ok"
    stage.processor.prompts.chat_template = None
    stage.processor.tokenizer.chat_template = None
    stage._rendered.clear()
    with pytest.raises(SetupError, match="chat template"):
        stage.prepare_one(row)
    (ckpt / "chat_template.jinja").unlink()
    with pytest.raises(SetupError, match="chat template"):
        PreprocessStage(cfg)


def test_triton_attention_on_the_cpu_is_a_setup_error():
    from vlbatch.operators.errors import SetupError
    from vlbatch.operators.kernels.attention import select_attention

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 runs the Triton kernel on the CPU on purpose")
    with pytest.raises(SetupError, match="model.engine.attention"):
        select_attention("triton", "cpu")


@pytest.mark.ray
def test_the_cause_of_a_real_ray_actor_failure(tmp_path):
    """`describe` on what a real Ray Data run raises when a UDF's constructor fails: a ConfigError
    cause is exit 2, any other exit 8 (EXIT_SETUP_FAILED); one line; the traceback in the log."""
    import ray

    from vlbatch.jobs.failures import describe
    from vlbatch.operators.errors import ConfigError

    class BadConfig:
        def __init__(self):
            raise ConfigError("model.path: the checkpoint is broken\nsecond line")

        def __call__(self, batch):
            return batch

    class BadDisk:
        def __init__(self):
            raise OSError(28, "No space left on device")

        def __call__(self, batch):
            return batch

    caught = []  # on the session's Ray (tests/conftest.py), connected in this process
    for udf in (BadConfig, BadDisk):
        ds = ray.data.range(4).map_batches(udf, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.1)
        with pytest.raises(Exception) as info:  # noqa: PT011 - whatever Ray raises is what describe gets
            ds.materialize()
        caught.append(info.value)
    log = tmp_path / "err.log"
    first, second = (describe(e, None, log) for e in caught)
    assert first.exit_code == 2 and second.exit_code == 8
    assert "ConfigError: model.path: the checkpoint is broken; second line" in first.line, first.line
    assert "OSError" in second.line and "No space left on device" in second.line, second.line
    assert all("\n" not in f.line for f in (first, second))
    assert "Traceback" in log.read_text()
