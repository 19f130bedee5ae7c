"""The bundled demo model (models/shapes-tiny): layout, loading, answers on held-out synthetic scenes.

The held-out set (scene seeds never used in training) runs three ways:
- the full pipeline (`run_job` on the session's local Ray, media as PNG / H.264 MP4
  files, Parquet out): scored against ground truth; acceptance from issue 8 is
  >= 90% of image attributes and >= 80% of video motion answers correct;
- transformers' `generate` (greedy, fp32) on the same decoded frames;
- our engine in this process on the same frames: its greedy answers equal transformers'.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlbatch.devtools.scenes.heldout import heldout_items
from vlbatch.devtools.scenes.score import is_well_formed

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "shapes-tiny"
N_IMAGES, N_VIDEOS = 60, 40  # 12 per image task, 10 per video task


@pytest.fixture(scope="module")
def reference():
    from vlbatch.devtools.training.evaluate import load_reference

    torch.set_num_threads(2)
    return load_reference(MODEL_DIR)


@pytest.fixture(scope="module")
def heldout(reference):
    """(items, generated answers) of the held-out set, generated once for this module."""
    from vlbatch.devtools.training.evaluate import decoded_item, generate

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


@pytest.mark.slow
def test_our_loader_gives_the_reference_logits(reference):
    """vlbatch.operators.model.load_model reads the bundled checkpoint; logits match transformers on images and videos.

    The trained model's logits reach about +-26, and in fp32 both implementations land up to
    ~2e-4 from an fp64 run of the reference (measured), so the fp32 comparison allows 5e-4
    absolute, and the sharper check is against fp64: ours is within twice transformers' fp32
    error of it, or within 1e-5 of the logit range (ours and theirs trade places item by item).
    """
    import copy

    from vlbatch.devtools.training.batches import media_kwargs, prompt_text
    from vlbatch.operators.model import load_model

    model, processor = reference
    exact = copy.deepcopy(model).double()
    ours = load_model(MODEL_DIR, dtype=torch.float32)
    for item in heldout_items(2, 2):
        inputs = processor(text=[prompt_text(processor, item)], return_tensors="pt", **media_kwargs([item]))
        with torch.no_grad():
            want = model(**inputs).logits
            got = ours(**{k: v for k, v in inputs.items() if k != "attention_mask"})
            truth = exact(**{k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-4)
        ours_err, ref_err = (got.double() - truth).abs().max(), (want.double() - truth).abs().max()
        scale = truth.abs().max()  # fp32 rounding grows with the logits' size
        assert ours_err <= max(2 * ref_err, 1e-5 * scale), (item.id, float(ours_err), float(ref_err), float(scale))
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_bundled_answers_are_well_formed_and_stop(heldout):
    """Every answer is a sentence of its task's answer language and ends with <|im_end|> (no thinking)."""
    items, generated = heldout
    bad = [(it.id, g.text) for it, g in zip(items, generated, strict=True) if not is_well_formed(it.qa.task, g.text)]
    assert len(bad) <= len(items) // 20, bad[:5]
    assert all(g.stopped for g in generated)
    assert not any("<think>" in g.text or "</think>" in g.text for g in generated)


@pytest.mark.slow
def test_engine_gives_the_reference_greedy_answers(heldout):
    """Our engine (batched, caches on) answers every held-out item with transformers' greedy tokens."""
    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.factory import load_engine
    from vlbatch.operators.preprocess import Processor

    items, generated = heldout
    proc = Processor.from_pretrained(MODEL_DIR)
    engine = load_engine(MODEL_DIR, device="cpu", dtype="float32")
    requests = []
    for it in items:
        text = proc.apply_chat_template(it.messages(), add_generation_prompt=True, enable_thinking=False)
        media = {"images": [it.image]} if it.media_type == "image" else {"videos": [it.video]}
        requests.append(Request.from_processor(it.id, proc(text=text, **media), 0,
                                               sampling=SamplingParams(max_new_tokens=48)))
    ours = {r.id: r for r in engine.generate(requests)}
    mismatched = [(it.id, g.text, ours[it.id].text) for it, g in zip(items, generated, strict=True)
                  if tuple(ours[it.id].token_ids) != g.token_ids]
    assert not mismatched, mismatched[:3]


@pytest.fixture
def pipeline_answers(ray_cluster, tmp_path_factory):
    """The held-out set through `run_job` (the session's Ray, 2 CPUs; local Parquet): (items, {media path: row})."""
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job

    root = tmp_path_factory.mktemp("bundled_pipeline")
    items = heldout_items(N_IMAGES, N_VIDEOS)
    paths = [str(it.write_media(root / "media")) for it in items]
    manifest = root / "heldout.jsonl"
    manifest.write_text("".join(json.dumps({"media_uri": p, "qs": [it.qa.question]}) + "\n"
                                for p, it in zip(paths, items, strict=True)))
    cfg = {
        "model": {"path": str(MODEL_DIR), "backend": "engine", "dtype": "float32", "device": "cpu"},
        "input": {"uri": str(manifest), "format": "jsonl",
                  "columns": {"media": "media_uri", "media_type": None, "questions": "qs"}},
        "task": {"mode": "questions", "thinking": False},
        "sampling": {"max_tokens": 48},
        "resources": {"preprocess": {"num_cpus": 0.5, "batch_size": 8, "max_actors": 1},
                      "model": {"num_cpus": 1, "batch_size": 32},
                      "write": {"num_cpus": 0.25, "batch_size": 16}},
        "output": {"uri": str(root / "out"), "run_id": "heldout"},
        "max_error_fraction": 0.0,
    }
    summary = run_job(validate_config(cfg))
    rows = ParquetSink(str(root / "out" / "heldout")).read().to_pylist()
    return items, paths, summary, {r["media_uri"]: r for r in rows}


@pytest.mark.ray
def test_pipeline_answers_heldout_scenes_correctly(pipeline_answers):
    """Issue 8 acceptance: >= 90% of image attributes, >= 80% of video motion answers, via the pipeline."""
    from vlbatch.devtools.scenes.score import score_answers

    items, paths, summary, rows = pipeline_answers
    assert len(rows) == len(items) and all(rows[p]["status"] == "ok" for p in paths)
    assert [rows[p]["prompt"] for p in paths] == [it.qa.question for it in items]
    scores = score_answers(items, [rows[p]["answer"] for p in paths])
    print("bundled model via the pipeline:", scores.summary())
    assert scores.image_attribute_accuracy >= 0.90, scores.summary()
    assert scores.video_motion_accuracy >= 0.80, scores.summary()
