"""Engine API behaviour: seeded sampling, stop conditions, thinking split, streaming, error results."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine_support import assert_static_used, image, processed, reference_model, request, video

from vlbatch.operators.engine import MediaItem, Request, SamplingParams
from vlbatch.operators.engine.scheduling.sequence import Sequence
from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.operators.factory import load_engine

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("dense")


@pytest.fixture(scope="module")
def engine(ckpt, engine_kw):
    return load_engine(ckpt, kv_budget_bytes=16 << 20, **engine_kw)


def _one(engine, req):
    (res,) = list(engine.generate([req]))
    return res


def test_seeded_sampling_equals_transformers_and_ignores_batch(ckpt, engine, engine_kw):
    content = [("image", image(1)), "Describe it."]
    req = request(ckpt, "s", content, max_new_tokens=10, seed=77, **SAMPLING)
    out = processed(ckpt, content)
    inputs = {k: v for k, v in out.items() if k not in ("position_ids", "rope_deltas")}
    torch.manual_seed(77)  # generate draws from the global generator: same stream as our per-request one
    with torch.no_grad():
        ref = reference_model(str(ckpt)).generate(**inputs, max_new_tokens=10, **SAMPLING)
    alone = _one(engine, req)
    assert list(alone.token_ids) == ref[0, out["input_ids"].shape[1]:].tolist()
    others = [request(ckpt, f"o{i}", [("video", video(i)), "What happens?"], max_new_tokens=4 + i, seed=i,
                      **SAMPLING) for i in range(5)]
    batched = {r.id: r for r in engine.generate(others[:3] + [req] + others[3:])}
    assert batched["s"].token_ids == alone.token_ids
    other = _one(engine, dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=78)))
    assert other.token_ids != alone.token_ids
    assert_static_used(engine.stats(), engine_kw)


def test_stop_tokens_stop_strings_and_length(ckpt, engine):
    base = request(ckpt, "g", [("image", image(2)), "Describe it."], max_new_tokens=12)
    greedy = _one(engine, base)
    assert greedy.finish_reason == "length" and greedy.generated_tokens == 12
    stop_tok = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_tok)
    r = _one(engine, dataclasses.replace(base, sampling=dataclasses.replace(base.sampling, stop_token_ids=(stop_tok,))))
    assert r.finish_reason == "stop" and r.token_ids == greedy.token_ids[: first + 1]
    stop = greedy.text.strip()[len(greedy.text.strip()) // 2:][:3]
    r = _one(engine, dataclasses.replace(base, sampling=dataclasses.replace(base.sampling, stop_strings=(stop,))))
    assert r.finish_reason == "stop" and stop not in r.text and greedy.text.startswith(r.text)
    assert r.generated_tokens < 12 and r.token_ids == greedy.token_ids[: r.generated_tokens]


def test_results_stream_as_requests_finish(ckpt, engine):
    long = request(ckpt, "long", ["Write a caption."], max_new_tokens=16, stop_token_ids=())
    short = request(ckpt, "short", ["Write a caption."], max_new_tokens=2, stop_token_ids=())
    order = [r.id for r in engine.generate([long, short])]
    assert order == ["short", "long"]


def test_thinking_is_split_from_the_answer(ckpt, engine):
    req = request(ckpt, "t", ["Think first."], thinking=True)
    tok = engine.tokenizer
    ids = tok("a plan</think>\n\nthe answer", add_special_tokens=False)["input_ids"]
    seq = Sequence(req, None, (), None)
    seq.token_ids += ids + [engine.eos_ids[0]]
    res = engine._result(seq, "stop")
    assert (res.thinking, res.text) == ("a plan", "the answer")
    assert res.generated_tokens == len(ids) + 1 and res.prompt_tokens == req.prompt_len
    cut = Sequence(req, None, (), None)  # the budget ran out while thinking: no </think>
    cut.token_ids += tok("still planning", add_special_tokens=False)["input_ids"]
    res = engine._result(cut, "length")
    assert (res.thinking, res.text) == ("still planning", "")


def test_split_thinking_is_one_rule():
    """The engine and the transformers backend share it; Qwen3.5's template opens <think> in the prompt."""
    from vlbatch.operators.engine.request import split_thinking

    assert split_thinking(" a plan</think>\n\nthe answer ") == ("a plan", "the answer")
    assert split_thinking("a</think>b</think>c") == ("a", "b</think>c")  # the first tag closes the block
    assert split_thinking("cut off mid-thought\n") == ("cut off mid-thought", "")
    assert split_thinking("</think>only the answer") == ("", "only the answer")


def test_bad_requests_become_error_results_and_others_finish(ckpt, engine_kw):
    engine = load_engine(ckpt, kv_budget_bytes=400 << 10, **engine_kw)
    ok = request(ckpt, "ok", [("image", image(5)), "Describe it."], max_new_tokens=3)
    too_long = request(ckpt, "long", ["word " * 300], max_new_tokens=3)
    m = ok.media[0]
    bad_grid = dataclasses.replace(ok, id="grid", media=(MediaItem(m.kind, m.frames, m.grid_thw,
                                                                   ((m.spans[0][0], m.spans[0][1] - 1),), m.spec),))
    res = {r.id: r for r in engine.generate([too_long, bad_grid, ok])}
    assert res["ok"].finish_reason == "length" and res["ok"].visual_tokens == m.num_tokens
    assert res["long"].finish_reason == "error" and "KV pool" in res["long"].error
    assert res["long"].error_type == "InputError" and res["ok"].error_type is None
    assert res["grid"].finish_reason == "error" and "placeholders" in res["grid"].error
    with pytest.raises(InputError):
        Request(id="x", prompt_token_ids=(1, 2), position_ids=torch.zeros(3, 3, dtype=torch.long))


def test_requests_from_our_processor_batch_match_the_reference_route(ckpt, engine):
    """A padded two-prompt batch from vlbatch.operators.preprocess (numpy) -> the same requests and outputs."""
    from vlbatch.operators.preprocess.processor import Processor
    from vlbatch.operators.types import VideoClip

    proc = Processor.from_pretrained(ckpt)
    vid, img = video(3), image(6, 48, 64)
    clip = VideoClip(frames=vid, source_fps=2.0, total_frames=len(vid), indices=tuple(range(len(vid))))
    prompts = [[("image", img), "Describe it."], [("video", vid), ("image", img), "Compare the two, please."]]
    texts = []
    for content in prompts:
        parts = [{"type": c[0]} if isinstance(c, tuple) else {"type": "text", "text": c} for c in content]
        texts.append(proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                              enable_thinking=False))
    out = proc(text=texts, images=[img, img], videos=[clip])
    ours = [Request.from_processor(f"p{i}", out, i, sampling=SamplingParams(max_new_tokens=6)) for i in range(2)]
    refs = [request(ckpt, f"p{i}", prompts[i], max_new_tokens=6) for i in range(2)]
    for a, b in zip(ours, refs, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids and a.rope_delta == b.rope_delta
        assert torch.equal(a.position_ids, b.position_ids)
        assert [(m.kind, m.grid_thw, m.spans) for m in a.media] == [(m.kind, m.grid_thw, m.spans) for m in b.media]
        for ma, mb in zip(a.media, b.media, strict=True):
            torch.testing.assert_close(ma.model_input("cpu", torch.float32), mb.model_input("cpu", torch.float32),
                                       atol=1e-5, rtol=0)
    got = {r.id: r.token_ids for r in engine.generate(ours)}
    want = {r.id: r.token_ids for r in engine.generate(refs)}
    assert got == want


def test_abandoned_generate_releases_everything(ckpt, engine_kw):
    engine = load_engine(ckpt, kv_budget_bytes=4 << 20, prefix_cache_bytes=0, **engine_kw)
    reqs = [request(ckpt, f"a{i}", ["Write a caption."], max_new_tokens=2 + 6 * i, stop_token_ids=()) for i in range(3)]
    gen = engine.generate(reqs)
    first = next(gen)
    gen.close()  # the consumer stops early: nothing may stay allocated
    assert engine.runner.pool.num_free == engine.config.max_num_seqs
    assert engine.blocks.num_free == engine.blocks.num_blocks
    again = {r.id: r.token_ids for r in engine.generate(reqs)}
    assert again[first.id] == first.token_ids and len(again) == 3


def test_submit_while_running_equals_generate(ckpt, engine):
    """The incremental API: a second batch submitted mid-run joins the running batch (the
    first batch's sequences are still decoding when it arrives) and every request gives
    the tokens `generate` gives it alone."""
    first = [request(ckpt, f"a{i}", [("image", image(i)), "Describe it."], max_new_tokens=8 + i, stop_token_ids=())
             for i in range(3)]
    second = [request(ckpt, f"b{i}", [("video", video(i)), "What happens?"], max_new_tokens=6, stop_token_ids=())
              for i in range(2)]
    bad = dataclasses.replace(second[0], id="bad", prompt_token_ids=(10**9,) + second[0].prompt_token_ids[1:])
    want = {r.id: r.token_ids for r in engine.generate(first + second)}
    assert engine.submit(first) == []
    done = {r.id: r for r in engine.step()}
    done.update({r.id: r for r in engine.step()})
    running = engine.scheduler.running
    assert {s.request.id for s in running} == {"a0", "a1", "a2"}
    rejected = engine.submit([*second, bad])
    assert [(r.id, r.finish_reason) for r in rejected] == [("bad", "error")]
    steps_together = 0
    while engine.has_work:
        ids = {s.request.id for s in engine.scheduler.running}
        steps_together += bool(ids & {"a0", "a1", "a2"} and ids & {"b0", "b1"})
        done.update({r.id: r for r in engine.step()})
    assert steps_together > 0  # the second batch ran beside the first, not after it
    assert {k: r.token_ids for k, r in done.items()} == want


def test_the_factory_names_an_unknown_prefix_cache(ckpt):
    """`EngineConfig.prefix_cache` picks the store (radix tree or its dict twin); an unknown one is
    refused with the choices, before any request."""
    with pytest.raises(ConfigError, match=r"^EngineConfig.prefix_cache: unknown prefix cache 'lru'; "
                                          r"allowed: radix, dict$"):
        load_engine(ckpt, prefix_cache="lru")
    assert type(load_engine(ckpt, prefix_cache="dict").prefix_cache).__name__ == "DictPrefixCache"
