"""The bundled demo model (models/shapes-tiny): layout, loading, answers on held-out synthetic scenes.

The held-out set (scene seeds never used in training) runs through transformers'
`generate` (greedy, fp32); videos go through real H.264 files (encoded, decoded
with PyAV, sampled at 2 fps). Acceptance from issue 8: >= 90% of image attributes
and >= 80% of video motion answers correct.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from operators.scenes.heldout import heldout_items
from operators.scenes.score import is_well_formed

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "shapes-tiny"
N_IMAGES, N_VIDEOS = 40, 32


@pytest.fixture(scope="module")
def reference():
    from operators.training.evaluate import load_reference

    torch.set_num_threads(2)
    return load_reference(MODEL_DIR)


@pytest.fixture(scope="module")
def heldout(reference):
    """(items, generated answers) of the held-out set, generated once for this module."""
    from operators.training.evaluate import decoded_item, generate

    model, processor = reference
    items = [decoded_item(it) for it in heldout_items(N_IMAGES, N_VIDEOS)]
    return items, generate(model, processor, items)


def test_bundled_checkpoint_is_small_and_in_hf_layout():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "preprocessor_config.json", "video_preprocessor_config.json", "generation_config.json"} <= names
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 8 * 2**20
    config = json.loads((MODEL_DIR / "config.json").read_text())
    layer_types = config["text_config"]["layer_types"]
    assert "linear_attention" in layer_types and "full_attention" in layer_types
    image = json.loads((MODEL_DIR / "preprocessor_config.json").read_text())
    assert image["size"]["longest_edge"] <= 100 * 32 * 32  # at most ~100 merged visual tokens per image


def test_bundled_model_loads_in_fp32(reference):
    model, _ = reference
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"


def test_our_loader_gives_the_reference_logits(reference):
    """operators.model.load_model reads the bundled checkpoint; logits match transformers on an image and a video."""
    from operators.model import load_model
    from operators.training.batches import media_kwargs, prompt_text

    model, processor = reference
    ours = load_model(MODEL_DIR, dtype=torch.float32)
    for item in heldout_items(1, 1):
        inputs = processor(text=[prompt_text(processor, item)], return_tensors="pt", **media_kwargs([item]))
        with torch.no_grad():
            want = model(**inputs).logits
        kwargs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        got = ours(**kwargs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bundled_answers_are_well_formed_and_stop(heldout):
    """Every answer is a sentence of its task's answer language and ends with <|im_end|> (no thinking)."""
    items, generated = heldout
    bad = [(it.id, g.text) for it, g in zip(items, generated, strict=True) if not is_well_formed(it.qa.task, g.text)]
    assert len(bad) <= len(items) // 20, bad[:5]
    assert all(g.stopped for g in generated)
    assert not any("<think>" in g.text or "</think>" in g.text for g in generated)
