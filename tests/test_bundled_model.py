"""The bundled demo model (models/shapes-tiny) really describes held-out synthetic scenes.

Runs the checkpoint through transformers' `generate` (greedy, fp32) on a held-out
set (scene seeds never used in training); videos go through real H.264 files
(encoded, decoded with PyAV, sampled at 2 fps). Acceptance from issue 8:
>= 90% of image attributes and >= 80% of video motion answers correct.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from operators.scenes.heldout import heldout_items
from operators.scenes.score import score_answers

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "shapes-tiny"
N_IMAGES, N_VIDEOS = 60, 48


@pytest.fixture(scope="module")
def reference():
    import torch

    from operators.training.evaluate import load_reference

    torch.set_num_threads(2)
    return load_reference(MODEL_DIR)


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
    import torch

    model, _ = reference
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"


def test_bundled_model_scores_on_heldout_scenes(reference):
    from operators.training.evaluate import decoded_item, generate_answers

    model, processor = reference
    items = [decoded_item(it) for it in heldout_items(N_IMAGES, N_VIDEOS)]
    answers = generate_answers(model, processor, items)
    scores = score_answers(items, answers)
    print(scores.summary())
    assert all(a and "<think>" not in a for a in answers), "answers are plain text that stopped at <|im_end|>"
    assert scores.image_attribute_accuracy >= 0.90, scores.summary()
    assert scores.video_motion_accuracy >= 0.80, scores.summary()
