"""benchmarks/bench_engine_gpu.py, the GPU run of the engine benchmark, kept runnable: no
GPU is lent to CI, so its 9B shape is checked against seed 000 without weights, and the
whole script runs here at the tiny shape on the CPU (its figures are not asserted, only
what it counts)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from benchmarks import bench_engine_gpu as bench


def test_nine_b_shape_is_the_seeds(tmp_path):
    from vlbatch.operators.model import ModelConfig, Qwen35Model

    cfg = ModelConfig.from_pretrained(bench.write_config(tmp_path, "9b"))
    t, v = cfg.text, cfg.vision
    assert (t.hidden_size, t.num_hidden_layers, len(t.linear_layers), t.intermediate_size, t.vocab_size) == \
        (4096, 32, 24, 12288, 248320)
    assert t.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (16, 4, 256)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim,
            t.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert (t.partial_rotary_factor, tuple(t.mrope_section), t.rope_theta) == (0.25, (11, 11, 10), 1e7)
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size, v.patch_size,
            v.num_position_embeddings) == (27, 1152, 4304, 16, 4096, 16, 2304)
    assert not cfg.tie_word_embeddings
    with torch.device("meta"):
        model = Qwen35Model(cfg)
    assert 9.3e9 < sum(p.numel() for p in model.parameters()) < 9.5e9  # 9.41B with the vision tower


def test_config_without_transformers_reads_the_same(tmp_path):
    from vlbatch.operators.model import ModelConfig

    saved = ModelConfig.from_pretrained(bench.write_config(tmp_path / "a", "9b"))
    raw = ModelConfig.from_pretrained(bench.write_config(tmp_path / "b", "9b", use_transformers=False))
    assert raw == saved and raw.text.hidden_size == 4096


@pytest.mark.slow
def test_runs_end_to_end_at_the_tiny_shape_on_cpu(tmp_path):
    ckpt = tmp_path / "ckpt"
    res = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "3",
                      "--new-tokens", "5", "--dir", str(ckpt), "--kv-gb", "0.0625"])  # (16 GiB by default: a GPU's)
    assert res["generated"] == 15 and res["kernels"] == "torch" and res["decode_steps"] >= 1
    # the weights a decode step reads, counted from the file: decoder (no embedding table) + LM head
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    want = sum(4 * torch.Size(s).numel() for k, s in sizes.items()
               if (k.startswith("model.language_model.") and "embed_tokens" not in k) or k == "lm_head.weight")
    assert res["weight_bytes"] == want
    assert res["bytes_moved"] > res["decode_steps"] * want and res["bandwidth"] > 0


@pytest.mark.slow
def test_kernel_check_reuses_the_loaded_model_and_counts_identical_tokens(tmp_path):
    """On the CPU only the torch kernels exist: torch against torch must agree everywhere, and
    the model keeps the kernels it had."""
    from vlbatch.operators.factory import load_engine
    from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule

    ckpt = bench.write_config(tmp_path, "tiny")
    bench.write_random_weights(ckpt, "cpu", torch.float32)
    reqs = bench.make_requests(ckpt, 2, 4)
    budgets = {"kv_budget_bytes": 8 << 20, "max_num_seqs": 4, "max_num_batched_tokens": 2048}
    engine = load_engine(ckpt, **budgets)
    line = bench.check_kernels(engine, reqs, "cpu", budgets, names=("torch", "torch"))
    assert line.startswith("8 of 8 greedy tokens identical") and "[None, None]" in line
    assert all(m.kernels == TorchDeltaRule() for m in engine.model.modules() if hasattr(m, "kernels"))


@pytest.mark.slow
def test_backend_check_counts_tokens_across_static_decode(tmp_path):
    """On the CPU: sdpa with static decode off and on; both must give every token of the first."""
    from vlbatch.operators.factory import load_engine

    ckpt = bench.write_config(tmp_path, "tiny")
    bench.write_random_weights(ckpt, "cpu", torch.float32)
    reqs = bench.make_requests(ckpt, 2, 4)
    budgets = {"kv_budget_bytes": 8 << 20, "max_num_seqs": 4, "max_num_batched_tokens": 2048}
    engine = load_engine(ckpt, **budgets)
    assert bench.check_backends(engine, reqs, budgets) == \
        "greedy tokens identical to sdpa eager: sdpa 8/8, sdpa+static 8/8"
