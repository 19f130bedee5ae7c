"""End-to-end engine exactness on tiny checkpoints (dense and MoE): images, videos, several media.

Greedy outputs must be identical whether a request runs alone or in a batch of 32 with
mixed lengths, with the prefix and vision caches on or off (the prefix cache: the radix tree
and its naive twin), with chunked prefill, and after preemption; and equal to transformers'
generate on the same prompt.
"""
from __future__ import annotations

import pytest
from test_engine_support import assert_static_used, image, reference_greedy, request, video

from vlbatch.operators.factory import load_engine

SYSTEM = "You are a careful visual assistant. Answer briefly."
QUESTIONS = ["Describe the image.", "What colour dominates?", "Count the objects in the scene please."]


def _contents():
    """32 prompts: shared images / videos with several questions, multi-media, text only."""
    out = []
    for i, (h, w) in enumerate([(40, 56), (64, 48), (32, 96), (80, 80)]):
        out += [[("image", image(i, h, w)), q] for q in QUESTIONS]
    for i in range(2):
        out += [[("video", video(i)), q] for q in ["What happens?", "Where is this?", "Who moves first?"]]
    out.append([("video", video(5, frames=6)), ("image", image(9)), "Compare them."])
    out.append([("image", image(10)), "and", ("image", image(11, 48, 40)), "Which is brighter?"])
    for i in range(12):
        out.append(["Write a short caption number " + " ".join(["word"] * (i * 3)) + f" {i}."])
    return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dense(tiny_ckpt):
    return tiny_ckpt("dense")


@pytest.fixture(scope="module")
def dense_requests(dense):
    return [request(dense, f"r{i}", c, max_new_tokens=6 + i % 5, system=SYSTEM if i % 2 == 0 else None)
            for i, c in enumerate(_contents())]


def _run(ckpt, reqs, engine_kw, **kw) -> dict:
    kw.setdefault("kv_budget_bytes", 16 << 20)
    engine = load_engine(ckpt, **engine_kw, **kw)
    results = {r.id: r for r in engine.generate(reqs)}
    assert sorted(results) == sorted(r.id for r in reqs)
    assert all(r.finish_reason in ("stop", "length") for r in results.values())
    assert_static_used(engine.stats(), engine_kw)
    return {k: v.token_ids for k, v in results.items()}, engine.stats()


@pytest.fixture(scope="module")
def alone(dense, dense_requests, engine_kw):
    out = {}
    for r in dense_requests:
        out.update(_run(dense, [r], engine_kw, prefix_cache_bytes=0, vision_cache_bytes=0)[0])
    return out


@pytest.mark.slow
def test_alone_equals_transformers_generate(dense, dense_requests, alone):
    contents = _contents()
    for i in (0, 12, 18, 19, 20):  # image, video, video + image, two images, text
        r = dense_requests[i]
        ref = reference_greedy(dense, contents[i], r.sampling.max_new_tokens, system=SYSTEM if i % 2 == 0 else None)
        assert list(alone[r.id]) == ref, r.id


@pytest.mark.parametrize("name,kw", [
    ("batched_caches_on", {}),
    ("batched_caches_on_dict_prefix_cache", {"prefix_cache": "dict"}),
    ("batched_caches_off", {"prefix_cache_bytes": 0, "vision_cache_bytes": 0}),
    ("chunked_prefill", {"chunk_size": 7, "max_num_batched_tokens": 64}),
    ("preemption", {"kv_budget_bytes": 400 << 10, "max_num_seqs": 32}),
])
@pytest.mark.slow
def test_batch_of_32_equals_alone(dense, dense_requests, alone, engine_kw, name, kw):
    got, stats = _run(dense, dense_requests, engine_kw, **kw)
    assert got == alone
    if name.startswith("batched_caches_on"):
        assert stats["prefix_hit_tokens"] > 0 and stats["vision_encodes"] == 10
    if name == "batched_caches_off":
        assert stats["prefix_hit_tokens"] == 0 and stats["vision_encodes"] == 12 + 6 + 2 + 2
    if name == "preemption":
        assert stats["preemptions"] > 0


@pytest.mark.parametrize("kw", [{"prefix_cache_bytes": 0}, {"vision_cache_bytes": 0}])
def test_each_cache_alone_keeps_outputs(dense, dense_requests, alone, engine_kw, kw):
    got, stats = _run(dense, dense_requests, engine_kw, **kw)
    assert got == alone
    if "vision_cache_bytes" in kw:
        # siblings whose prefix hit covers their media skip the tower: one encode per distinct
        # (system prompt or not, media) prefix: 4 images x 2 + 2 videos x 2 + 2 two-item prompts x 2
        assert stats["vision_encodes"] == 16 and stats["vision_cache_hits"] == 0


@pytest.mark.slow
def test_moe_batch_equals_alone_and_transformers(tiny_ckpt, engine_kw):
    moe = tiny_ckpt("moe")
    contents = _contents()
    picks = [0, 1, 3, 12, 13, 18, 19, 20, 25]
    reqs = [request(moe, f"m{i}", contents[i], max_new_tokens=6, system=SYSTEM) for i in picks]
    alone = {}
    for r in reqs:
        alone.update(_run(moe, [r], engine_kw, prefix_cache_bytes=0, vision_cache_bytes=0)[0])
    for i in (0, 18):
        assert list(alone[f"m{i}"]) == reference_greedy(moe, contents[i], 6, system=SYSTEM)
    got, stats = _run(moe, reqs, engine_kw, kv_budget_bytes=300 << 10, chunk_size=16)
    assert got == alone and stats["prefix_hit_tokens"] > 0


def test_decode_over_scattered_slots_updates_the_pools_in_place(dense, dense_requests, alone, engine_kw,
                                                                monkeypatch):
    """Requests finish at different steps, so the running sequences' slots scatter; those decode
    steps update the conv and recurrent states where the pool keeps them (the compiled kernels
    indexing the pool, `StepCache.linear_pools`), and the outputs stay those of each alone."""
    from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule
    from vlbatch.operators.model.ops import conv_cpu

    calls = {"conv": 0, "delta": 0}

    def counted(key, fn):
        def call(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(conv_cpu, "conv1d_step_slots_cpu", counted("conv", conv_cpu.conv1d_step_slots_cpu))
    monkeypatch.setattr(TorchDeltaRule, "decode_slots_", counted("delta", TorchDeltaRule.decode_slots_))
    got, _ = _run(dense, dense_requests, engine_kw, prefix_cache_bytes=0, vision_cache_bytes=0)
    assert got == alone
    if engine_kw.get("device", "cpu") == "cpu" and not engine_kw.get("static_decode"):
        assert calls["conv"] > 0 and calls["delta"] > 0, calls  # (conv: its load warm-up calls count too)
