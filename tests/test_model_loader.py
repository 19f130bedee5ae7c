"""Checkpoint loading: sharded == single file, stacked or per-expert MoE weights, mtp tensors,
dtype casting, and errors that name the offending tensors."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model import CheckpointError, load_model


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _variant_dir(src, dst, tensors: dict[str, torch.Tensor]):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _same_params(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_sharded_checkpoint_loads_identically(tiny_ckpt):
    sharded = tiny_ckpt("dense", shards=2)
    assert (sharded / "model.safetensors.index.json").is_file()
    _same_params(load_model(tiny_ckpt("dense")), load_model(sharded))


def test_loaded_weights_equal_the_file(tiny_ckpt):
    path = tiny_ckpt("dense")
    model, raw = load_model(path), _tensors(path)
    params = dict(model.named_parameters())
    assert torch.equal(params["lm_head.weight"], raw["lm_head.weight"])
    name = "language_model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(params[name], raw["model." + name])
    assert not any(p.requires_grad for p in params.values())


def test_tied_checkpoint_has_no_head_and_reuses_embedding(tiny_ckpt):
    path = tiny_ckpt("dense_tied")
    assert "lm_head.weight" not in _tensors(path)
    model = load_model(path)
    assert model.lm_head is None
    hidden = torch.randn(2, model.config.text.hidden_size)
    expected = model.language_model.norm(hidden) @ model.language_model.embed_tokens.weight.t()
    assert torch.allclose(model.logits(hidden), expected)


def test_moe_per_expert_and_stacked_forms_load_the_same(tiny_ckpt, tmp_path):
    path = tiny_ckpt("moe")
    raw = _tensors(path)
    cfg_e = 8
    stacked = {k: v for k, v in raw.items() if ".experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in raw if ".mlp.experts." in k}
    for prefix in layers:
        gate_up = [torch.cat([raw[f"{prefix}.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                   for e in range(cfg_e)]
        stacked[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{prefix}.mlp.experts.down_proj"] = torch.stack(
            [raw[f"{prefix}.mlp.experts.{e}.down_proj.weight"] for e in range(cfg_e)]
        )
    _same_params(load_model(path), load_model(_variant_dir(path, tmp_path / "stacked", stacked)))


def test_mtp_tensors_are_kept(tiny_ckpt, tmp_path):
    path = tiny_ckpt("dense")
    raw = _tensors(path)
    raw["mtp.fc.weight"] = torch.randn(64, 128)
    model = load_model(_variant_dir(path, tmp_path / "mtp", raw))
    assert torch.equal(model.mtp_weights["mtp.fc.weight"], raw["mtp.fc.weight"])


def test_dtype_cast(tiny_ckpt):
    model = load_model(tiny_ckpt("dense"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 770, (1, 20), generator=torch.Generator().manual_seed(0))
    ref = load_model(tiny_ckpt("dense"))(ids)
    got = model(ids)
    assert got.dtype == torch.bfloat16
    # bf16 rounding through 8 layers: a few percent of the logit scale, not a different answer
    assert (got.float() - ref).abs().max().item() < 0.15 * ref.abs().max().item()
    assert (got.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize(
    "edit,fragment",
    [
        ("missing", "missing tensors: ['language_model.layers.0.linear_attn.A_log']"),
        ("unexpected", "unexpected tensors: ['model.language_model.layers.0.bogus.weight']"),
        ("misshaped", "model.language_model.layers.3.self_attn.k_proj.weight: checkpoint [7, 64]"),
        ("missing_expert", "missing tensors: ['language_model.layers.0.mlp.experts.gate_up_proj']"),
    ],
)
def test_bad_checkpoints_name_the_tensor(tiny_ckpt, tmp_path, edit, fragment):
    variant = "moe" if edit == "missing_expert" else "dense"
    path = tiny_ckpt(variant)
    raw = _tensors(path)
    if edit == "missing":
        del raw["model.language_model.layers.0.linear_attn.A_log"]
    elif edit == "unexpected":
        raw["model.language_model.layers.0.bogus.weight"] = torch.zeros(3)
    elif edit == "misshaped":
        raw["model.language_model.layers.3.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    else:
        del raw["model.language_model.layers.0.mlp.experts.5.up_proj.weight"]
    with pytest.raises(CheckpointError) as err:
        load_model(_variant_dir(path, tmp_path / edit, raw))
    assert fragment in str(err.value)
    assert isinstance(err.value, ConfigError)


def test_missing_files_are_clear_errors(tiny_ckpt, tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)
    shutil.copy(tiny_ckpt("dense") / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


@pytest.mark.slow
def test_model_runs_without_importing_transformers(tiny_ckpt):
    code = (
        "import sys, torch; from vlbatch.operators.model import load_model; "
        f"m = load_model({str(tiny_ckpt('moe'))!r}); m(torch.tensor([[1, 2, 3]])); "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
