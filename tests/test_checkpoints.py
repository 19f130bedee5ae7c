"""The tiny checkpoints load through transformers exactly as a real Qwen3.5 checkpoint does."""
import json

import pytest
import torch


@pytest.mark.parametrize("variant", ["dense", "dense_tied", "moe"])
def test_tiny_checkpoint_loads_in_transformers(tiny_ckpt, variant):
    from transformers import AutoModelForImageTextToText

    path = tiny_ckpt(variant)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_5_moe" if variant == "moe" else "qwen3_5")
    model = AutoModelForImageTextToText.from_pretrained(path)
    names = set(model.state_dict())
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.") for n in names)
    tied = model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == (variant == "dense_tied")
    out = model(input_ids=torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, cfg["text_config"]["vocab_size"])


def test_sharded_checkpoint_has_index(tiny_ckpt):
    path = tiny_ckpt("dense", shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2


def test_tokenizer_has_qwen_special_tokens_and_template(tiny_ckpt):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_ckpt("dense"))
    tok = proc.tokenizer
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
              "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, t
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]}]
    off = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    on = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert off == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                   "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Hi"
                   "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n<think>\n")
