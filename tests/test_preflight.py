"""`vlbatch validate` catches what `vlbatch run` would die on (issue 33 "Validate must catch what run
would die on"; issue 31 items 5, 6, 9): the checkpoint (config.json, architecture, tokenizer, chat
template, processor configs, safetensors only, the tensor-parallel split, tensor shapes), the engine
against the device, a local output.uri, and the pool plan against this machine (CPUs, GPUs,
memory; default pools sized down rather than refused). Driven through the real CLI (a subprocess,
no Ray started); each case passed validate on 6a0b046."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_jobs_support import REPO, TEST_ENV

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import validate_config


def _job(tmp_path, model_dir, extra: str = "") -> str:
    media = tmp_path / "media"
    media.mkdir(exist_ok=True)
    from PIL import Image

    Image.new("RGB", (32, 24), (200, 30, 30)).save(media / "a.png")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{uri: "{media}/*.png", format: glob}}
sampling: {{max_tokens: 4}}
output: {{uri: {tmp_path / 'out'}}}
{extra}""")
    return str(cfg)


def _validate(cfg: str, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = dict(os.environ, **TEST_ENV)
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "validate", cfg, *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300, env=env, cwd=REPO)


@pytest.fixture()
def ckpt(tmp_path, tiny_ckpt):
    """A private copy of the tiny checkpoint, to break."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("dense"), out)
    return out


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    target = data.get("text_config", data) if "text_config" in data and set(changes) - set(data) else data
    target.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.slow
def test_tp_that_does_not_divide_is_refused_in_one_line_before_torch(tmp_path, ckpt):
    cfg = _job(tmp_path, ckpt)
    r = _validate(cfg, "--set", "model.tensor_parallel_size=3")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.tensor_parallel_size" in lines[0] and "linear_num_key_heads=2" in lines[0], lines
    assert r.stdout == ""
    # fast: the split is read from config.json without importing torch (or Ray)
    probe = ("import sys\nfrom vlbatch.pipeline.config import load_config\n"
             "from vlbatch.pipeline.plan.checkpoint import check_model\n"
             f"c = load_config({cfg!r}, ['model.tensor_parallel_size=3'])\n"
             "try:\n    check_model(c)\nexcept Exception as e:\n    print(type(e).__name__)\n"
             "print('torch' in sys.modules, 'ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.stdout.split() == ["ConfigError", "False", "False"], out.stdout + out.stderr


def _no_chat_template(ckpt):
    (ckpt / "chat_template.jinja").unlink()


def _decoy_weights(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "decoy.safetensors")


def _pickle_beside_decoy(ckpt):
    _decoy_weights(ckpt)
    (ckpt / "pytorch_model.bin").write_bytes(b"never read")


BROKEN = {
    "no_chat_template": (_no_chat_template, "chat template"),
    "no_preprocessor_config": (lambda c: (c / "preprocessor_config.json").unlink(), "preprocessor_config.json"),
    "no_tokenizer": (lambda c: (c / "tokenizer.json").unlink(), "tokenizer.json"),
    "decoy_safetensors": (_decoy_weights, "no model.safetensors"),
    "pickle_beside_decoy": (_pickle_beside_decoy, "pytorch_model.bin"),
    "edited_head_counts": (lambda c: _edit_json(c / "config.json", num_attention_heads=2), "mis-shaped"),
    "config_not_json": (lambda c: (c / "config.json").write_text("{oops"), "config.json"),
    "unsupported_architecture": (lambda c: _edit_json(c / "config.json", model_type="llama"), "model_type"),
    "missing_shard": (lambda c: (c / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})), "missing"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_checkpoint_is_refused_at_validate(tmp_path, ckpt, case):
    breaker, expect = BROKEN[case]
    breaker(ckpt)
    r = _validate(_job(tmp_path, ckpt))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model.path" in r.stderr and expect in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_engine_and_output_problems_are_refused_at_validate(tmp_path, ckpt):
    cfg = _job(tmp_path, ckpt)
    r = _validate(cfg, "--set", "model.engine.attention=triton")  # a CUDA kernel, the model on the CPU
    assert r.returncode == 2 and "model.engine.attention" in r.stderr, r.stdout + r.stderr
    r = _validate(cfg, "--set", "model.engine.delta_rule=fla")  # fla's Triton kernels, the model on the CPU
    assert r.returncode == 2 and "model.engine.delta_rule: fla is a CUDA kernel" in r.stderr, r.stdout + r.stderr
    (tmp_path / "afile").write_text("x")
    r = _validate(cfg, "--set", f"output.uri={tmp_path / 'afile'}")
    assert r.returncode == 2 and "output.uri" in r.stderr and "is a file" in r.stderr, r.stdout + r.stderr


@pytest.mark.slow
def test_resources_the_machine_cannot_hold_are_refused_at_validate(tmp_path, ckpt):
    cfg = _job(tmp_path, ckpt)
    r = _validate(cfg, "--set", "resources.model.memory_gb=100000")
    assert r.returncode == 2 and "resources.model.memory_gb" in r.stderr, r.stdout + r.stderr
    r = _validate(cfg, "--set", "resources.preprocess.num_cpus=64")  # the user's own figure: refused, not changed
    assert r.returncode == 2 and "resources" in r.stderr and "CPUs" in r.stderr, r.stdout + r.stderr
    import torch

    if not torch.cuda.is_available():  # a CPU-only machine: a GPU model would wait forever
        r = _validate(cfg, "--set", "model.device=cuda", "--set", "resources.model.num_gpus=1")
        assert r.returncode == 2 and "model.device" in r.stderr, r.stdout + r.stderr


@pytest.mark.slow
def test_default_pools_fit_the_machine_and_validate_says_so(tmp_path, ckpt):
    from vlbatch.pipeline.plan.cluster import Cluster
    from vlbatch.pipeline.plan.fit import fit_defaults, fit_problems
    from vlbatch.pipeline.plan.spec import pools

    r = _validate(_job(tmp_path, ckpt))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pools:" in r.stdout and "this machine" in r.stdout, r.stdout
    base = {"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}}
    cfg = validate_config(base)
    small = Cluster(cpus=2.0, gpus=0.0, memory_bytes=8 << 30, fixed_size=True, where="a 2-CPU machine")
    assert fit_problems(cfg, small)  # the defaults ask 2.30 CPUs
    fitted, sized = fit_defaults(cfg, small)
    assert set(sized) == {"preprocess", "model", "write"} and not fit_problems(fitted, small)
    assert fitted.resolved_run_id() == cfg.resolved_run_id()  # resources never change the run
    tiny = Cluster(cpus=1.0, gpus=0.0, memory_bytes=8 << 30, fixed_size=True, where="one CPU")
    assert not fit_problems(fit_defaults(cfg, tiny)[0], tiny)
    mine = validate_config({**base, "resources": {"model": {"num_cpus": 1.5}}})
    fitted, sized = fit_defaults(mine, small)
    assert "model" not in sized and fitted.resources.model.num_cpus == 1.5  # what the user set stays
    assert sum(p.actor_cpus * p.min_actors for p in pools(fitted, small)) <= 2.0


def test_tp_replica_resources_are_exact_ray_quantities(tmp_path):
    from vlbatch.pipeline.plan.spec import stage_specs

    base = {"model": {"path": "m", "tensor_parallel_size": 3}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)},
            "resources": {"model": {"num_cpus": 0.1}}}
    model = next(s for s in stage_specs(validate_config(base), None) if s.name == "model")
    assert model.ray_args()["num_cpus"] == 0.3  # not 0.30000000000000004


@pytest.mark.slow
def test_validate_json_into_a_closed_pipe_is_quiet(tmp_path, ckpt):
    """`vlbatch validate --json | head`: the reader is gone before validate writes (its end of the
    pipe closed first), so every write fails; no BrokenPipeError traceback, exit 141."""
    cfg = _job(tmp_path, ckpt)
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    try:
        r = _validate(cfg, "--json", stdout=w_fd)
    finally:
        os.close(w_fd)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 141


def test_transformers_backend_never_unpickles(tmp_path, ckpt, monkeypatch):
    """Issue 31 item 9: a pytorch_model.bin beside a decoy safetensors is refused before loading;
    torch.load is never called (a spy on it: the one thing that would unpickle)."""
    import torch

    _decoy_weights(ckpt)
    torch.save({"w": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or real(*a, **k))
    from vlbatch.pipeline.backends.backends import TransformersBackend

    cfg = validate_config({"model": {"path": str(ckpt), "backend": "transformers", "device": "cpu"},
                           "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}})
    with pytest.raises(ConfigError, match="model.safetensors"):
        TransformersBackend(cfg)
    assert calls == []


@pytest.mark.ray
def test_validate_plans_against_the_cluster_it_would_join(tmp_path, ckpt, ray_cluster):
    """--address: the plan is the joined cluster's (the session's Ray, 2 CPUs), and what does not fit is a
    warning there (a cluster may add nodes), not a refusal."""
    cfg = _job(tmp_path, ckpt)
    r = _validate(cfg, "--address", ray_cluster.address, "--set", "resources.preprocess.num_cpus=64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of 2 CPUs, 0 GPUs" in r.stdout and ray_cluster.address in r.stdout, r.stdout
    assert "resources" in r.stderr and "waiting for the cluster to add nodes" in r.stderr, r.stderr


@pytest.mark.ray
def test_a_config_without_resources_runs_on_this_machine(tmp_path, ckpt):
    """The hidden-style user: a fresh config, no resources section, `vlbatch run` on this machine
    (2 CPUs on the CI runner: the defaults ask 2.30, so they are sized down, and the run completes;
    on 6a0b046 it was refused after Ray had started). Its own local Ray (no RAY_ADDRESS): the defaults
    sized to this machine's plan are the subject, not a joined cluster's."""
    from vlbatch.pipeline.plan.cluster import local_cluster

    cfg = _job(tmp_path, ckpt)
    env = dict(os.environ, **TEST_ENV, HOME=str(tmp_path))
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "run", cfg, "--no-lock"], capture_output=True,
                       text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done: 1 ok, 0 error" in r.stdout.splitlines()[-1], r.stdout
    if local_cluster().cpus < 2.3:
        assert "[vlbatch] resources: default CPU shares sized to this machine" in r.stdout, r.stdout
