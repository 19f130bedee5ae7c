"""benchmarks/gpu_run.sh kept runnable between device draws: its CPU rehearsal runs here with a
python3 that holds only what the device machine's holds (benchmarks/device_env.py: a venv
without system site-packages linking torch, transformers, triton, numba, numpy, pillow,
safetensors, tokenizers, jinja2, pyarrow, fsspec, pyyaml and their dependencies from this
interpreter; no ray, pydantic, decord, av, s3fs, blake3, nor this project). blake3, av,
torchcodec and xgrammar (with its tvm-ffi and pydantic) are carried as wheels, as on the device
(packed from this interpreter's installs). A step importing
anything else, or the tree not importing as `vlbatch.*`, fails the rehearsal. Figures are not
asserted, only what the steps count and compare."""
from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from benchmarks import device_env, tree_site

ROOT = Path(__file__).resolve().parent.parent
# 04_structured's, as gpu_wheels.sh downloads them for the device (xgrammar imports pydantic and tvm_ffi)
XGRAMMAR = ("xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")


@pytest.fixture(scope="module")
def device_python(tmp_path_factory):
    """(python of the device-like venv, folder holding the blake3, av and torchcodec wheels)."""
    tmp = tmp_path_factory.mktemp("device_env")
    python = device_env.build(tmp / "venv")
    for name in ("av", "torchcodec", *XGRAMMAR):  # 02b_decode's and 04_structured's
        device_env.wheel_from_installed(name, tmp / "wheels")
    return python, device_env.wheel_from_installed("blake3", tmp / "wheels").parent


def _run(python: Path, *args: str, env: dict | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_the_env_holds_the_device_packages_and_nothing_of_ours(device_python):
    python, _ = device_python
    ok = _run(python, "-c", "import torch, transformers, triton, numba, numpy, PIL, safetensors, tokenizers, "
                            "jinja2, pyarrow, fsspec, yaml")
    assert ok.returncode == 0, ok.stderr
    for absent in ("ray", "pydantic", "decord", "av", "s3fs", "blake3", "vlbatch", "pytest"):
        proc = _run(python, "-c", f"import {absent}")
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, absent


@pytest.mark.slow
def test_check_names_what_is_missing(device_python, tmp_path):
    """Without the carried wheel the engine cannot import (blake3): the one-line check says so and fails."""
    python, _ = device_python
    tree_site.make_site(tmp_path / "site")
    proc = _run(python, "-m", "benchmarks.gpu_check", "--cpu", env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 1
    (line,) = proc.stdout.splitlines()
    assert "missing: blake3" in line and "transformers " in line and "vlbatch from the tree: ModuleNotFound" in line


def test_structured_step_says_skipped_without_xgrammar(device_python, tmp_path):
    """The device env holds no xgrammar unless it is carried: 04_structured then says so in one line and
    exits 0 (its JSON says why), never a traceback that fails the GPU run."""
    python, _ = device_python
    tree_site.make_site(tmp_path / "site")
    out = tmp_path / "s.json"
    proc = _run(python, "-m", "benchmarks.bench_structured", "--device", "cuda", "--json", str(out),
                env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("skipped: no xgrammar in the device env (ModuleNotFoundError") and "gpu_wheels.sh" in line
    assert json.loads(out.read_text())["skipped"] == line.removeprefix("skipped: ")


def test_tree_site_mirrors_setup_py(tmp_path):
    assert tree_site.roots() == {"operators": "operators", "pipeline": "pipeline", "jobs": "jobs",
                                 "models": "models", "devtools": "scripts/devtools"}
    site = tree_site.make_site(tmp_path)
    assert (site / "vlbatch" / "devtools").resolve() == (ROOT / "scripts" / "devtools").resolve()
    bad = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("x-1.0.data/scripts/run", "")
    with pytest.raises(ValueError, match="data folder"):
        tree_site.unpack_wheels(tmp_path, [bad])


def _json(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


@pytest.mark.slow
def test_rehearsal_runs_every_step_in_the_device_env(device_python, tmp_path):
    python, wheels = device_python
    out = tmp_path / "out"
    env = {"PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}", "WHEELS": str(wheels), "OUT": str(out),
           "PYTHONPATH": ""}
    proc = subprocess.run(["bash", "benchmarks/gpu_run.sh", "--rehearse"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (out / "summary.txt").read_text().split("\n")[:-1] == [
        f"{s}: exit 0" for s in ("00_check", "01_parity", "01b_parity_bf16", "02_kernels", "02b_decode", "03_nine_b",
                                 "04_structured")]
    check = _json(out, "00_check.json")
    assert check["missing"] == [] and check["carried"]["blake3"]
    parity = _json(out, "01_parity.json")
    assert parity["verdict"] == "same tokens" and parity["transformers"]
    assert sorted((c["variant"], c["prompt"]) for c in parity["cases"] if c["same"] and c["tokens"] == 8) == \
        sorted((v, p) for v in ("dense", "dense_tied", "moe") for p in ("image", "video"))
    assert all(c["logits_ok"] and c["max_logit_err_vs_float32"]["ours"] < 1e-3 for c in parity["cases"])
    bf16 = _json(out, "01b_parity_bf16.json")  # the report's shape, not its verdict (CPU rounding decides it)
    assert len(bf16["cases"]) == 6 and bf16["dtype"] == "bfloat16"
    for c in bf16["cases"]:
        div = c["first_divergence"]
        assert c["same"] == (div is None) and set(c["median_logit_err_vs_float32"]) == {"ours", "ref"}
        if div is not None and "ref_logits" in div:
            assert div["tie"] in ("logits", "router", None) and {"ref_token", "ours_token"} == set(div["ours_logits"])
            assert c["variant"] == "moe" or div["router_margin"] is None  # dense models have no router
    kernels = _json(out, "02_kernels.json")
    assert kernels["failed"] == []
    assert {"torch/bfloat16", "naive/float32"} <= set(kernels["delta_rule"])
    assert set(kernels["attention"]) == {"triton/float32", "triton/bfloat16"}  # really ran, in the interpreter
    assert {"padded/float32", "padded/bfloat16"} <= set(kernels["moe"])
    decode = _json(out, "02b_decode.json")  # the deferred route on the CPU: the CPU stage's frames exactly
    assert decode["skipped"] is None and decode["device"] == "cpu"
    assert decode["clips"]["tiny"]["identical"] and decode["clips"]["tiny"]["frames"] == 4
    cap = _json(out, "03a_captions.json")["variants"]
    assert set(cap) == {"auto", "auto+static"}
    assert all(v["tokens_same_as_first"] == "12/12" and v["decode_steps"] >= 1 for v in cap.values())
    vqa = _json(out, "03b_video_qa.json")
    assert vqa["identical_outputs"] and (vqa["on"]["vision_encodes"], vqa["off"]["vision_encodes"]) == (1, 3)
    assert vqa["on"]["prefix_hit_tokens"] > 0 == vqa["off"]["prefix_hit_tokens"]
    assert _json(out, "03c_memory.json")["planned_bytes"]["kv_pool"] == 64 << 20
    hf = _json(out, "03d_transformers.json")
    assert set(hf["batches"]) == {"1", "3"} and hf["engine_over_best"] > 0
    structured = _json(out, "04_structured.json")  # ran (xgrammar carried): a grammar per format, the split
    assert structured["skipped"] is None and structured["device"] == "cpu"
    arms = structured["arms"]
    assert [arms[a]["compilations"] for a in ("free", "json", "choice")] == [0, 1, 1]
    assert all(arms[a]["tokens"] == 4 * 8 and arms[a]["full_steps"] >= 1 for a in arms)
    assert arms["json"]["fill_s"] > 0 and arms["free"]["fill_s"] == 0
    assert {o["verdict"].split(" (")[0] for o in structured["overlap"].values()} == {"not overlapped on the CPU"}
