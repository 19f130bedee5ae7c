"""`forward_packed`: sequences of different lengths in one step (the engine's call) give the
same logits as running each sequence alone through `forward` with its own cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbatch.operators.model import ContiguousCache, load_model, mrope_positions
from vlbatch.operators.model.layers import unfuse_linears


@pytest.fixture(scope="module", params=["dense", "moe"])
def setup(request, tiny_ckpt):
    from transformers import AutoProcessor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_ckpt(request.param)
    yield load_model(path), AutoProcessor.from_pretrained(path)
    torch.set_num_threads(threads)


def _sequences(processor):
    gen = torch.Generator().manual_seed(0)
    image = np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    media = processor(text=[text], images=[image], return_tensors="pt")
    return [
        {"input_ids": torch.randint(0, 770, (1, 17), generator=gen)},
        {k: media[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")},
        {"input_ids": torch.randint(0, 770, (1, 5), generator=gen)},
    ]


def _prompt_embeds(model, seq):
    ids = seq["input_ids"][0]
    emb = model.embed(ids)
    if "pixel_values" in seq:
        emb[ids == model.config.image_token_id] = torch.cat(model.encode_media(seq["pixel_values"], seq["image_grid_thw"]))
        pos, delta = mrope_positions(seq["mm_token_type_ids"], seq["image_grid_thw"], None, 2)
        return emb, pos[:, 0], int(delta[0])
    return emb, torch.arange(len(ids)).expand(3, -1), 0


@pytest.mark.parametrize("step2", [(1, 3, 1), (1, 1, 3)], ids=["decodes-apart", "decodes-first"])
def test_ragged_steps_equal_separate_sequences(setup, step2):
    """Step 2 mixes decodes and a chunk, with the decodes apart (their rows gathered) or in one
    run (their rows a slice, as the scheduler packs running decodes first)."""
    model, processor = setup
    seqs = _sequences(processor)
    gen = torch.Generator().manual_seed(1)
    follow = [torch.randint(0, 770, (1, n + 1), generator=gen) for n in step2]  # step 2, then step 3: (1, 1, 1)

    expected = []  # per sequence: logits of prompt's last token, then of each follow-up token
    for seq, more in zip(seqs, follow, strict=True):
        cache = ContiguousCache(model.config.text, 1)
        first = model(cache=cache, logits_to_keep=1, **seq)[0]
        rest = [model(more[:, i : i + 1], cache=cache)[0] for i in range(more.shape[1])]
        expected.append(torch.cat([first] + rest))

    cache = ContiguousCache(model.config.text, 3, capacity=4)
    prompts = [_prompt_embeds(model, s) for s in seqs]
    deltas = [d for _, _, d in prompts]
    lens = [e.shape[0] for e, _, _ in prompts]
    cache.begin_step(lens)
    last = torch.tensor(lens).cumsum(0) - 1
    got = [model.forward_packed(torch.cat([e for e, _, _ in prompts]), torch.cat([p for _, p, _ in prompts], 1), cache, last)]
    cache.end_step()
    for step_lens, offset in ((step2, 0), ((1, 1, 1), None)):
        toks, pos = [], []
        for i, n in enumerate(step_lens):
            start = 0 if offset is not None else step2[i]
            toks.append(follow[i][0, start : start + n])
            pos.append(cache.seq_lens[i] + deltas[i] + torch.arange(n))
        cache.begin_step(step_lens)
        idx = torch.arange(sum(step_lens))
        got.append(model.forward_packed(model.embed(torch.cat(toks)), torch.cat(pos).expand(3, -1), cache, idx))
        cache.end_step()

    # regroup the packed outputs per sequence: step1 one row each; step2 rows `step2`; step3 one each
    rows2 = got[1].split(list(step2))
    for i in range(3):
        ours = torch.cat([got[0][i : i + 1], rows2[i], got[2][i : i + 1]])
        assert ours.shape == expected[i].shape
        assert (ours - expected[i]).abs().max().item() < 1e-4, f"sequence {i}"


def _unfused(model):
    """The same model on the reference path: separate projections (fused weights dropped)."""
    import copy

    ref = copy.deepcopy(model)
    for m in ref.modules():
        if getattr(m, "fused_weight", None) is not None:
            unfuse_linears(m)
    return ref


def test_fused_projections_and_kept_rows_equal_the_reference_path(setup):
    """Fused projections (load-time transform) and the last layer run on kept rows only give
    the logits of separate projections over every row; parameters keep checkpoint names."""
    model, processor = setup
    i = model.config.text.linear_layers[0]
    assert f"language_model.layers.{i}.linear_attn.in_proj_z.weight" in dict(model.named_parameters())
    layer = model.language_model.layers[i].linear_attn
    assert layer.fused_weight is not None and layer.in_proj_z.weight.data_ptr() > layer.fused_weight.data_ptr()
    ref = _unfused(model)
    prompts = [_prompt_embeds(model, s) for s in _sequences(processor)]
    lens = [e.shape[0] for e, _, _ in prompts]
    embeds, pos = torch.cat([e for e, _, _ in prompts]), torch.cat([p for _, p, _ in prompts], 1)
    last = torch.tensor(lens).cumsum(0) - 1
    outs = []
    for m, idx in ((model, last), (ref, last), (ref, torch.arange(sum(lens)))):
        cache = ContiguousCache(model.config.text, 3, capacity=4)
        cache.begin_step(lens)
        outs.append(m.forward_packed(embeds, pos, cache, idx))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4
    assert (outs[1] - outs[2][last]).abs().max().item() < 1e-4


def test_the_projection_form_is_chosen_once_at_load(setup):
    """Every fusable module runs its fused projection without checking `fused_weight` per call:
    the form is bound at load (issue 32), and `unfuse_linears` restores the separate one."""
    model, _ = setup
    fusable = [m for m in model.language_model.modules() if hasattr(m, "fuse_")]
    assert len(fusable) >= len(model.language_model.layers)  # every mixer, and the dense FFNs
    for m in fusable:
        assert m._project.__func__ is type(m)._project_fused
    ref = _unfused(model)
    for m in ref.language_model.modules():
        if hasattr(m, "fuse_"):
            assert m._project.__func__ is type(m)._project and m.fused_weight is None
