"""Our model against transformers' Qwen3_5(Moe)ForConditionalGeneration on tiny random checkpoints.

Both are loaded from the same checkpoint directory in this run (fp32, CPU); inputs come
from transformers' AutoProcessor on real numpy images and video frame arrays. Logits
must agree within 1e-4 absolute; the largest difference per case is printed (`-s`).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vlbatch.operators.model import ContiguousCache, load_model
from vlbatch.operators.model.greedy import greedy_generate

TOL = 1e-4
MAX_DIFFS: dict[str, float] = {}


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest and fair to a shared CI box
    loaded = {}

    def get(variant: str):
        if variant not in loaded:
            path = tiny_ckpt(variant)
            ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
            loaded[variant] = (load_model(path), ref, AutoProcessor.from_pretrained(path))
        return loaded[variant]

    yield get
    torch.set_num_threads(threads)


def _image(seed: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    return np.kron(base, np.ones((8, 8, 1), dtype=np.uint8))[:h, :w]  # blocky, like real content


def _video(seed: int, frames: int, h: int, w: int) -> np.ndarray:
    return np.stack([_image(seed + i, h, w) for i in range(frames)])


PROMPTS = {
    "text": [{"type": "text", "text": "Write a short poem about the sea."}],
    "image": [{"type": "image"}, {"type": "text", "text": "Describe this image."}],
    "video": [{"type": "video"}, {"type": "text", "text": "What happens?"}],
    "several": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare the two."}],
    "mixed": [
        {"type": "text", "text": "First"},
        {"type": "image"},
        {"type": "text", "text": "then a clip"},
        {"type": "video"},
        {"type": "text", "text": "and one more picture"},
        {"type": "image"},
        {"type": "text", "text": "Summarise."},
    ],
}


def make_inputs(processor, kind: str) -> dict:
    content = PROMPTS[kind]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    n_img = sum(c["type"] == "image" for c in content)
    n_vid = sum(c["type"] == "video" for c in content)
    kwargs = {}
    if n_img:
        kwargs["images"] = [_image(i, 70 + 30 * i, 100 - 10 * i) for i in range(n_img)]
    if n_vid:
        kwargs["videos"] = [_video(10 + i, 10, 64, 96) for i in range(n_vid)]
        kwargs["video_metadata"] = [{"fps": 5.0, "total_num_frames": 10} for _ in range(n_vid)]
    return dict(processor(text=[text], return_tensors="pt", **kwargs))


def _ours_kwargs(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != "attention_mask"}


@pytest.mark.parametrize("variant", ["dense", "dense_tied", "moe"])
@pytest.mark.parametrize("kind", list(PROMPTS))
def test_logits_match_transformers(models, variant, kind):
    ours, ref, processor = models(variant)
    inputs = make_inputs(processor, kind)
    with torch.no_grad():
        expected = ref(**inputs).logits
    got = ours(**inputs)  # the processor's output as it is (attention_mask all ones)
    diff = (got - expected).abs().max().item()
    MAX_DIFFS[f"{variant}/{kind}"] = diff
    print(f"max |logits diff| {variant}/{kind}: {diff:.2e}")
    assert got.shape == expected.shape
    assert diff < TOL


def test_text_batch_and_logits_to_keep(models):
    ours, ref, _ = models("dense")
    ids = torch.randint(0, 770, (3, 29), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    assert (ours(ids) - expected).abs().max().item() < TOL
    last = ours(ids, logits_to_keep=1)
    assert last.shape == (3, 1, expected.shape[-1])
    assert (last[:, 0] - expected[:, -1]).abs().max().item() < TOL
    picked = ours(ids, logits_to_keep=torch.tensor([0, 7, 28]))
    assert (picked - expected[:, [0, 7, 28]]).abs().max().item() < TOL
    shifted = torch.arange(29).expand(3, 29).clone()
    shifted[:, 15:] += 5  # a gap (RoPE ignores a uniform shift): explicit positions are used, any spelling
    by_2d = ours(ids, position_ids=shifted[0].expand(3, 29), logits_to_keep=1)
    by_4d = ours(ids, position_ids=torch.cat([shifted[:1], shifted])[:, None].expand(4, 3, 29), logits_to_keep=1)
    assert torch.equal(by_2d, by_4d) and (by_2d - last).abs().max().item() > 1e-4


@pytest.mark.parametrize("variant,kind", [("dense", "image"), ("moe", "mixed"), ("dense_tied", "video")])
def test_prefill_then_decode_equals_full_forward(models, variant, kind):
    ours, _, processor = models(variant)
    inputs = _ours_kwargs(make_inputs(processor, kind))
    prompt = inputs.pop("input_ids")
    extra = torch.randint(0, 770, (1, 12), generator=torch.Generator().manual_seed(5))
    full_ids = torch.cat([prompt, extra], dim=1)
    mm = inputs.pop("mm_token_type_ids")
    full_mm = torch.cat([mm, torch.zeros_like(extra)], dim=1)
    full = ours(full_ids, mm_token_type_ids=full_mm, **inputs)

    cache = ContiguousCache(ours.config.text, 1, capacity=8)  # small: exercises growth
    steps = [ours(prompt, mm_token_type_ids=mm, cache=cache, **inputs)]
    for i in range(extra.shape[1]):
        steps.append(ours(extra[:, i : i + 1], cache=cache))
    assert cache.seq_lens == [full_ids.shape[1]]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < TOL


@pytest.mark.slow
@pytest.mark.parametrize("variant,kind", [("dense", "image"), ("dense_tied", "text"), ("moe", "video")])
def test_greedy_64_tokens_equal_transformers_generate(models, variant, kind):
    ours, ref, processor = models(variant)
    inputs = make_inputs(processor, kind)
    with torch.no_grad():
        out = ref.generate(**inputs, max_new_tokens=64, do_sample=False, eos_token_id=None)
    expected = out[0, inputs["input_ids"].shape[1] :]
    kwargs = _ours_kwargs(inputs)
    got = greedy_generate(ours, kwargs.pop("input_ids"), 64, **kwargs)[0]
    assert expected.shape == (64,)
    assert got.tolist() == expected.tolist()


def test_token_types_derived_from_placeholders(models):
    ours, _, processor = models("dense")
    inputs = _ours_kwargs(make_inputs(processor, "mixed"))
    with_types = ours(**inputs)
    inputs.pop("mm_token_type_ids")
    assert torch.equal(ours(**inputs), with_types)


def test_bad_media_inputs_are_input_errors(models):
    from vlbatch.operators.errors import InputError

    ours, _, processor = models("dense")
    inputs = _ours_kwargs(make_inputs(processor, "several"))
    with pytest.raises(InputError, match="padded"):
        ours(inputs["input_ids"], attention_mask=torch.zeros_like(inputs["input_ids"]))
    with pytest.raises(InputError, match="no image pixel values"):
        ours(inputs["input_ids"])
    first_image = int(inputs["image_grid_thw"][0].prod())
    with pytest.raises(InputError, match="image tokens but"):
        ours(**{**inputs, "pixel_values": inputs["pixel_values"][:first_image], "image_grid_thw": inputs["image_grid_thw"][:1]})
    cache = ContiguousCache(ours.config.text, 1)
    ours(inputs["input_ids"][:, :4], cache=cache)
    with pytest.raises(InputError, match="first"):
        ours(**inputs, cache=cache)


def test_batch_of_two_image_prompts(models):
    """B = 2 with media in both rows: features fill placeholders row by row, positions per row."""
    ours, ref, processor = models("moe")
    text = processor.apply_chat_template(
        [{"role": "user", "content": PROMPTS["image"]}], add_generation_prompt=True, tokenize=False
    )
    inputs = dict(processor(text=[text, text], images=[_image(1, 64, 96), _image(2, 64, 96)], return_tensors="pt"))
    assert bool(inputs["attention_mask"].all())
    with torch.no_grad():
        expected = ref(**inputs).logits
    got = ours(**inputs)
    assert (got - expected).abs().max().item() < TOL
    assert (got[0] - got[1]).abs().max().item() > 1e-3  # the two images really differ
