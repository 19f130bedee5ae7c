"""Training pieces of the bundled model: answer-only labels, the linear patch embedding, a short real run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from operators.training.batches import END, IGNORE, collate, prompt_text, sample_items
from operators.training.fast_patch import linear_patch_embed_forward, use_linear_patch_embed
from operators.training.shapes import IMAGE_SIZE, VIDEO_SIZE, main, write_processor_files


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    out = tmp_path_factory.mktemp("shapes_proc")
    write_processor_files(out)
    return AutoProcessor.from_pretrained(out)


def test_labels_cover_exactly_the_answer_and_im_end(processor):
    items = sample_items(np.random.default_rng(3), 6, 0.5, 1000)
    assert {it.media_type for it in items} == {"image", "video"}
    batch = collate(processor, items)
    tok = processor.tokenizer
    for row, item in enumerate(items):
        labels = batch["labels"][row]
        kept = labels[labels != IGNORE]
        assert tok.decode(kept) == item.qa.answer + END
        # the supervised tokens are the last real tokens of the row, right after the no-thinking prompt
        length = int(batch["attention_mask"][row].sum())
        assert torch.equal(batch["input_ids"][row, length - len(kept):length], kept)
        assert (labels[length:] == IGNORE).all()
        assert prompt_text(processor, item).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_visual_token_budgets_are_small(processor):
    items = sample_items(np.random.default_rng(4), 8, 0.5, 1000)
    batch = collate(processor, items)
    image_tokens = batch["image_grid_thw"].prod(-1) // 4
    video_tokens = batch["video_grid_thw"].prod(-1) // 4
    assert int(image_tokens.max()) <= IMAGE_SIZE["longest_edge"] // 1024
    assert int(video_tokens.max()) <= VIDEO_SIZE["longest_edge"] // 2048


@pytest.mark.parametrize("n_patches", [1, 7, 33])
def test_linear_patch_embed_matches_conv3d(n_patches):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionPatchEmbed

    class Cfg:
        patch_size, temporal_patch_size, in_channels, hidden_size = 16, 2, 3, 24

    torch.manual_seed(n_patches)
    embed = Qwen3_5VisionPatchEmbed(Cfg())
    x = torch.randn(n_patches, 3 * 2 * 16 * 16, requires_grad=True)
    ref = embed(x)
    (ref.square().sum()).backward()
    grad_ref, wgrad_ref = x.grad.clone(), embed.proj.weight.grad.clone()
    x.grad, embed.proj.weight.grad = None, None
    out = linear_patch_embed_forward(embed, x)
    (out.square().sum()).backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, grad_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(embed.proj.weight.grad, wgrad_ref, rtol=1e-4, atol=1e-4)
    wrapper = torch.nn.Sequential(embed)
    assert use_linear_patch_embed(wrapper) == 1


def test_short_training_run_saves_a_loadable_checkpoint(tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "ckpt"
    main(["--out", str(out), "--steps", "3", "--batch", "4", "--warmup", "1", "--log-every", "1", "--save-every", "0"])
    log = capsys.readouterr().out
    losses = [float(line.split()[3]) for line in log.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(np.isfinite(losses))
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.text_config.num_hidden_layers == 4
