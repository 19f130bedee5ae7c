"""Prefix-cache behaviour through the real engine: exact branch points, copy-on-write, eviction, media keys.

Every test runs against both prefix caches (the `cache_engine` fixture): the radix tree and its naive
twin, a dict of exact prefixes; their outputs must equal the engine's with caches off."""
from __future__ import annotations

import pytest
import torch
from test_engine_support import PREFIX_CACHES, assert_static_used, image, request

from vlbatch.operators.factory import load_engine

SYSTEM = "You are a careful visual assistant."
# shared text after the image, longer than a KV block: the questions' branch point gets its own snapshot
LEAD = "Look at the whole picture carefully, from left to right, then answer briefly. "
QUESTIONS = ["Describe it.", "Describe the colours.", "Describe the shapes in detail.", "Describe the mood.",
             "Describe the light.", "Describe the background."]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("dense")


@pytest.fixture(params=PREFIX_CACHES)
def cache_engine(request):
    """One prefix cache (`EngineConfig.prefix_cache`): the radix tree, its dict twin."""
    return request.param


def _engine(ckpt, engine_kw, cache="radix", **kw):
    kw.setdefault("kv_budget_bytes", 16 << 20)
    return load_engine(ckpt, prefix_cache=cache, **engine_kw, **kw)


def _spy_prompt_logits(engine) -> dict:
    """Record each request's first sampled logits (those of its last prompt token)."""
    rows: dict = {}
    run = engine.runner.run

    def recording(plan):
        logits = run(plan)
        for c, row in zip([c for c in plan.chunks if c.sample], logits, strict=False):
            rows.setdefault(c.seq.id, row.clone())
        return logits

    engine.runner.run = recording
    return rows


def _alone(ckpt, reqs, engine_kw) -> dict:
    out = {}
    for r in reqs:
        e = _engine(ckpt, engine_kw, prefix_cache_bytes=0, vision_cache_bytes=0)
        out.update({x.id: x.token_ids for x in e.generate([r])})
    return out


def _branch_point(a, b) -> int:
    n = 0
    while a.prompt_token_ids[n] == b.prompt_token_ids[n]:
        n += 1
    return n


def test_hit_at_exact_unaligned_branch_point_with_equal_logits(ckpt, engine_kw, cache_engine):
    img = ("image", image(3, 48, 64))
    reqs = [request(ckpt, f"q{i}", [img, LEAD + q], system=SYSTEM, max_new_tokens=5)
            for i, q in enumerate(QUESTIONS[:3])]
    bp = _branch_point(reqs[0], reqs[1])
    block = 16 if bp % 16 else 12
    # shared text after the image, more than a block of it (`spaced`), the branch mid-block
    assert bp % block and bp - reqs[0].media[0].spans[-1][1] >= 16
    cached, plain = _engine(ckpt, engine_kw, cache_engine, block_size=block), _engine(ckpt, engine_kw, block_size=block, prefix_cache_bytes=0)
    rows_c, rows_p = _spy_prompt_logits(cached), _spy_prompt_logits(plain)
    res_c = {r.id: r for r in cached.generate(reqs)}
    res_p = {r.id: r for r in plain.generate(reqs)}
    assert res_c["q0"].cached_tokens == 0
    # "Describe the" is shared by q1 and q2 only, one token deeper: no snapshot there (`spaced`)
    bp12 = _branch_point(reqs[1], reqs[2])
    assert 0 < bp12 - bp < block and [res_c[f"q{i}"].cached_tokens for i in (1, 2)] == [bp, bp]
    for i in range(3):
        assert res_c[f"q{i}"].token_ids == res_p[f"q{i}"].token_ids
        torch.testing.assert_close(rows_c[f"q{i}"], rows_p[f"q{i}"], atol=1e-4, rtol=0)
    assert cached.stats()["vision_encodes"] == 1  # the siblings' hits cover the image


def test_copy_on_write_isolation(ckpt, engine_kw, cache_engine):
    img = ("image", image(4, 40, 72))
    reqs = [request(ckpt, f"c{i}", [img, LEAD + q], system=SYSTEM, max_new_tokens=7) for i, q in enumerate(QUESTIONS)]
    alone = _alone(ckpt, reqs, engine_kw)
    engine = _engine(ckpt, engine_kw, cache_engine, block_size=16)
    first = {r.id: r.token_ids for r in engine.generate(reqs[:2])}
    bp = _branch_point(reqs[0], reqs[1])
    match = engine.prefix_cache.match(engine.codec.encode(reqs[2].prompt_token_ids, reqs[2].media), bp)
    assert match.length == bp
    snap = (match.snapshot.conv.clone(), match.snapshot.recurrent.clone())
    kv = engine.runner.kv[:, :, list(match.blocks)].clone()
    # siblings restore from the same snapshot and copy the shared tail block, then decode side by side
    later = {r.id: r for r in engine.generate(reqs[2:])}
    assert all(later[r.id].cached_tokens >= bp for r in reqs[2:])
    assert torch.equal(match.snapshot.conv, snap[0]) and torch.equal(match.snapshot.recurrent, snap[1])
    now = engine.runner.kv[:, :, list(match.blocks)]
    full = bp // 16
    assert torch.equal(now[:, :, :full], kv[:, :, :full])
    assert torch.equal(now[:, :, full, :, : bp % 16], kv[:, :, full, :, : bp % 16])
    assert {**first, **{k: v.token_ids for k, v in later.items()}} == alone
    assert_static_used(engine.stats(), engine_kw)


@pytest.mark.slow
def test_eviction_under_tight_budget_keeps_outputs(ckpt, engine_kw, cache_engine):
    reqs = [request(ckpt, f"e{g}{i}", [("image", image(20 + g, 40, 40)), q], system=SYSTEM, max_new_tokens=4)
            for g in range(4) for i, q in enumerate(QUESTIONS[:2])]
    alone = _alone(ckpt, reqs, engine_kw)
    probe = _engine(ckpt, engine_kw)
    budget = int(1.5 * probe.state_bytes_per_seq) + 8 * 16 * probe.kv_bytes_per_token
    engine = _engine(ckpt, engine_kw, cache_engine, prefix_cache_bytes=budget, max_num_seqs=4)
    got = {r.id: r.token_ids for r in engine.generate(reqs)}
    stats = engine.stats()
    assert got == alone
    assert stats["prefix_evicted_nodes"] > 0 and stats["prefix_cache_bytes"] <= budget
    assert stats["prefix_hit_tokens"] > 0


@pytest.mark.slow
def test_a_full_cache_evicts_what_no_queued_request_will_reuse(ckpt, engine_kw, cache_engine):
    """One sequence at a time, in this order: A, A, B, B, C, A; the cache holds the chat header
    and two image prefixes. When C's prefix comes in, B's was used last, but nobody waits for
    it, while A's last question still does: B's goes (plain LRU would drop A's)."""
    qs = ["Describe it.", "What colour is it?", "How many shapes are there?"]
    img = {k: ("image", image(50 + i, 48, 64)) for i, k in enumerate("ABC")}
    order = [("A", 0), ("A", 1), ("B", 0), ("B", 1), ("C", 0), ("A", 2)]
    reqs = [request(ckpt, f"{k}{i}", [img[k], qs[i]], system=SYSTEM, max_new_tokens=3) for k, i in order]
    alone = _alone(ckpt, reqs, engine_kw)
    roomy = _engine(ckpt, engine_kw, cache_engine, prefix_cache_bytes=1 << 30, max_num_seqs=1)
    roomy.submit(reqs)
    held = {}  # snapshots inserted -> prefix-cache bytes
    while roomy.has_work:
        roomy.step()
        held.setdefault(roomy.stats()["snapshots_inserted"], roomy.stats()["prefix_cache_bytes"])
    budget = held[3] + 1024  # the header, A's and B's prefixes: C's does not fit beside them
    engine = _engine(ckpt, engine_kw, cache_engine, prefix_cache_bytes=budget, max_num_seqs=1)
    res = {r.id: r for r in engine.generate(reqs)}
    assert engine.stats()["prefix_evicted_nodes"] > 0
    assert res["A2"].cached_tokens >= reqs[0].media[0].spans[-1][1]
    assert {k: v.token_ids for k, v in res.items()} == alone


def test_same_text_different_media_never_collide(ckpt, engine_kw, cache_engine):
    q = "Describe it."
    a = request(ckpt, "a", [("image", image(7, 48, 48)), q], system=SYSTEM)
    b = request(ckpt, "b", [("image", image(8, 48, 48)), q], system=SYSTEM)  # same size: same token ids
    c = request(ckpt, "c", [("image", image(7, 48, 48)), q], system=SYSTEM)
    assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids
    alone = _alone(ckpt, [a, b], engine_kw)
    assert alone["a"] != alone["b"]
    engine = _engine(ckpt, engine_kw, cache_engine)
    res = {r.id: r for r in engine.generate([a, b, c])}
    start, end = a.media[0].spans[0][0], a.media[0].spans[-1][1]
    assert res["b"].cached_tokens == start  # only the text before the image is shared
    assert res["c"].cached_tokens >= end  # the same image is shared
    assert res["a"].token_ids == res["c"].token_ids == alone["a"] and res["b"].token_ids == alone["b"]
    assert engine.stats()["vision_encodes"] == 2


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_siblings_diverging_at_a_second_media_reuse_the_shared_media_prefix(tiny_ckpt, engine_kw, cache_engine, variant):
    """One call: [system, A, question] x 3 and [system, A, C, question], [system, A, D, question].
    Every prompt but the first to run shares [system, A] with one already computing it, so each
    waits for it and starts from A's end (the spaced snapshot points agree on every prompt
    through A: a media's end is a point whether or not it is the prompt's last media)."""
    ckpt = tiny_ckpt(variant)
    a, c, d = (("image", image(s, 48, 64)) for s in (61, 62, 63))
    reqs = [request(ckpt, f"t{i}", [a, q], system=SYSTEM, max_new_tokens=4) for i, q in enumerate(QUESTIONS[:3])]
    reqs += [request(ckpt, "ac", [a, c, "Compare them."], system=SYSTEM, max_new_tokens=4),
             request(ckpt, "ad", [a, d, "Compare them."], system=SYSTEM, max_new_tokens=4)]
    end_a = reqs[0].media[0].spans[-1][1]
    assert reqs[3].media[0].spans[-1][1] == end_a and len(reqs[3].media) == 2
    alone = _alone(ckpt, reqs, engine_kw)
    engine = _engine(ckpt, engine_kw, cache_engine)
    res = {r.id: r for r in engine.generate(reqs)}
    assert res["t0"].cached_tokens == 0
    assert {k: v.cached_tokens >= end_a for k, v in res.items() if k != "t0"} == {k: True for k in res if k != "t0"}
    assert {k: v.token_ids for k, v in res.items()} == alone
    assert engine.stats()["vision_encodes"] == 3  # A once, C and D once each


def test_a_later_call_waits_for_a_prefix_another_call_is_computing(ckpt, engine_kw, cache_engine):
    """Call 1: two text prompts branching after a long shared lead; its first sequence is
    still computing that branch point (16-token chunks) when call 2 brings a third prompt
    through the same lead. Call 2 alone plans no point there, yet it waits for the prefix
    and starts from it rather than computing the lead a second time."""
    reqs = [request(ckpt, f"l{i}", [LEAD + LEAD + q], system=SYSTEM, max_new_tokens=4)
            for i, q in enumerate(QUESTIONS[:3])]
    bp = _branch_point(reqs[0], reqs[1])
    assert _branch_point(reqs[0], reqs[2]) == bp > 32
    alone = _alone(ckpt, reqs, engine_kw)
    engine = _engine(ckpt, engine_kw, cache_engine, chunk_size=16)
    done = {r.id: r for r in engine.submit(reqs[:2])}
    done.update({r.id: r for r in engine.step()})
    assert engine.scheduler.running and engine.scheduler.running[0].num_computed < bp
    done.update({r.id: r for r in engine.submit(reqs[2:])})
    while engine.has_work:
        done.update({r.id: r for r in engine.step()})
    assert [done[f"l{i}"].cached_tokens for i in range(3)] == [0, bp, bp]
    assert {k: v.token_ids for k, v in done.items()} == alone
