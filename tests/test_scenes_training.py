"""Training pieces of the bundled model: answer-only labels, the linear patch embedding, a short real run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbatch.devtools.training.batches import END, IGNORE, collate, prompt_text, sample_items
from vlbatch.devtools.training.fast_patch import linear_patch_embed_forward, use_linear_patch_embed
from vlbatch.devtools.training.shapes import IMAGE_SIZE, VIDEO_SIZE, main, write_processor_files


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


@pytest.mark.slow
def test_short_training_run_saves_a_loadable_checkpoint(tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "ckpt"
    main(["--out", str(out), "--steps", "3", "--batch", "4", "--warmup", "1", "--log-every", "1", "--save-every", "0",
          "--vision-steps", "2", "--vision-batch", "4"])
    log = capsys.readouterr().out
    losses = [float(line.split()[3]) for line in log.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert sum(line.startswith("vision step ") for line in log.splitlines()) == 2
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.text_config.num_hidden_layers == 4
    assert model.config.text_config.layer_types.count("full_attention") == 2
    assert "head" not in " ".join(n for n, _ in model.named_parameters() if "visual" in n)  # aux head not saved


def test_colour_classes_read_shape_pixels_only():
    from vlbatch.devtools.scenes.images import make_image_scene
    from vlbatch.devtools.scenes.vocab import COLOURS
    from vlbatch.devtools.training.token_labels import colour_classes

    for seed in range(6):
        scene = make_image_scene(seed)
        cls = colour_classes(scene.image)
        h, w = cls.shape
        names = list(COLOURS)
        for s in scene.shapes:  # the centre pixel of every shape has its colour
            assert names[cls[int(s.cy * h), int(s.cx * w)] - 1] == s.colour
        assert cls[0, 0] == 0 or all(abs(s.cx - 0) > 0.1 for s in scene.shapes)  # a corner is background
        assert 0.002 < (cls > 0).mean() < 0.5


def test_image_targets_label_the_token_under_each_shape(processor):
    from vlbatch.devtools.scenes.heldout import image_item
    from vlbatch.devtools.scenes.vocab import COLOURS, KINDS, SIZES
    from vlbatch.devtools.training.token_labels import image_targets, token_grid

    rng = np.random.default_rng(0)
    for seed in range(5):
        item = image_item(seed, "caption", rng)
        grid = collate(processor, [item])["image_grid_thw"][0].tolist()
        targets = image_targets(item.scene, grid)
        _, gh, gw = token_grid(grid)
        assert targets.shape == (gh * gw, 6)
        labelled = targets[targets[:, 0] > 0]
        for s in item.scene.shapes:  # every shape is the label of at least one token
            want = [list(COLOURS).index(s.colour) + 1, KINDS.index(s.kind) + 1, SIZES.index(s.size) + 1]
            assert any((row[:3] == want).all() for row in labelled), (seed, s)
        assert (targets[:, 0] == 0).mean() > 0.4  # most tokens are background
        assert targets[0, 3:5].tolist() == [0, 0]  # corners' places
        assert targets[-1, 3:5].tolist() == [(gh - 1) * 6 // gh, (gw - 1) * 6 // gw]
        assert len(set(targets[:, 4].tolist())) == min(gw, 6) and len(set(targets[:, 3].tolist())) == min(gh, 6)


def test_vision_targets_follow_the_merger_order(processor):
    """One target row per merger output row, images first then videos; the aux loss trains the tower."""
    from vlbatch.devtools.checkpoints import tiny
    from vlbatch.devtools.training.batches import vision_targets
    from vlbatch.devtools.training.shapes import TEXT, VISION
    from vlbatch.devtools.training.vision_aux import VisionAux

    items = sample_items(np.random.default_rng(5), 6, 0.5, 1000)
    batch = collate(processor, items)
    targets = vision_targets(batch, items)
    model = tiny.build_reference_model("dense", seed=0, vision_overrides=VISION, **TEXT).train()
    aux = VisionAux(model)
    opt = torch.optim.Adam(list(model.model.visual.parameters()) + list(aux.parameters()), lr=3e-3)
    losses = []
    for _ in range(8):
        aux.encode(model, batch)
        loss = aux.loss(targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    n_image = int(batch["image_grid_thw"].prod(-1).sum()) // 4
    n_video = int(batch["video_grid_thw"].prod(-1).sum()) // 4
    assert targets.shape == (n_image + n_video, 6)
    assert losses[-1] < 0.7 * losses[0]
    model(**batch)  # a full forward also feeds the hook: images, then videos
    assert sum(t.shape[0] for t in aux._outputs) == targets.shape[0]
    aux.remove()


def test_video_targets_carry_the_motion_of_the_moving_shape(processor):
    from vlbatch.devtools.scenes.heldout import video_item
    from vlbatch.devtools.scenes.vocab import COLOURS, DIRECTIONS
    from vlbatch.devtools.training.token_labels import IGNORE, video_targets

    rng = np.random.default_rng(1)
    seen = set()
    for seed in range(12):
        item = video_item(seed, "motion", rng)
        grid = collate(processor, [item])["video_grid_thw"][0].tolist()
        targets = video_targets(item.video.frames, grid, item.scene.shapes)
        assert targets.shape == (grid[0] * grid[1] * grid[2] // 4, 6)
        active = item.scene.shapes[0]
        if active.motion == "still" or any(s.colour_start == active.colour_start for s in item.scene.shapes[1:]):
            continue
        mine = targets[targets[:, 0] == list(COLOURS).index(active.colour_start) + 1]
        assert len(mine) and (mine[:, 5] == 2 + DIRECTIONS.index(active.motion)).all()
        seen.add(active.motion)
        assert (targets[targets[:, 0] == 0, 5] == 0).all() and not (targets[:, 1] != IGNORE).any()
    assert len(seen) >= 2
