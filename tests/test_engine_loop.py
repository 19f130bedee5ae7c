"""EngineLoop: concurrent callers share one continuous batch; back-pressure; failures stay contained.

Real engine on the tiny dense checkpoint, real threads. Where a test needs a caller to
arrive at an exact moment (during the first call's run, not before it), a wrapper around
`Engine.step` starts that caller; nothing is mocked.
"""
from __future__ import annotations

import threading

import pytest
from test_engine_support import image, request, video

from vlbatch.operators.engine import EngineLoop
from vlbatch.operators.factory import load_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("dense")


@pytest.fixture(scope="module")
def reqs(ckpt):
    """12 requests: 3 images x 2 questions, 2 videos x 2 questions, 2 text-only; no stop token."""
    out = []
    for i, (h, w) in enumerate([(40, 56), (64, 48), (32, 96)]):
        out += [request(ckpt, f"i{i}q{q}", [("image", image(i, h, w)), f"Question {q}?"], max_new_tokens=5 + q + i,
                        stop_token_ids=()) for q in range(2)]
    for i in range(2):
        out += [request(ckpt, f"v{i}q{q}", [("video", video(i)), f"What happens {q}?"], max_new_tokens=6,
                        stop_token_ids=()) for q in range(2)]
    out += [request(ckpt, f"t{i}", [f"Write caption {i}."], max_new_tokens=7, stop_token_ids=()) for i in range(2)]
    return out


def _engine(ckpt):
    return load_engine(ckpt, kv_budget_bytes=16 << 20)


@pytest.fixture(scope="module")
def expected(ckpt, reqs):
    return {r.id: r.token_ids for r in _engine(ckpt).generate(reqs)}


def _run_later(loop, reqs, out: dict, visual_tokens: int = 0) -> threading.Thread:
    t = threading.Thread(target=lambda: out.update(loop.run(reqs, visual_tokens)))
    t.start()
    return t


def _on_first_step(engine, action):
    """Wrap engine.step so `action()` runs once, right after the first step."""
    step, fired = engine.step, []

    def wrapped():
        res = step()
        if not fired:
            fired.append(True)
            action()
        return res

    engine.step = wrapped


def test_concurrent_calls_give_generates_tokens_each_once(ckpt, reqs, expected):
    loop = EngineLoop(_engine(ckpt), max_visual_tokens=10**6)
    outs = [{} for _ in range(4)]
    threads = [_run_later(loop, reqs[k::4], outs[k]) for k in range(4)]
    for t in threads:
        t.join(timeout=120)
    got = {}
    for k, o in enumerate(outs):
        assert sorted(o) == sorted(r.id for r in reqs[k::4])  # each call gets exactly its own results
        got.update(o)
    assert {k: v.token_ids for k, v in got.items()} == expected
    assert all(v.finish_reason == "length" for v in got.values())
    loop.close()


def test_a_call_arriving_mid_run_joins_the_running_batch(ckpt, reqs, expected):
    first, second = reqs[:6], reqs[6:]
    steps_alone = 0
    for part in (first, second):
        e = _engine(ckpt)
        list(e.generate(part))
        steps_alone += e.stats()["steps"]
    engine = _engine(ckpt)
    loop = EngineLoop(engine, max_visual_tokens=10**6)
    late: dict = {}
    threads = []
    _on_first_step(engine, lambda: threads.append(_run_later(loop, second, late)))
    early = loop.run(first)
    threads[0].join(timeout=120)
    assert {k: v.token_ids for k, v in {**early, **late}.items()} == expected
    # the second call was submitted while the first ran: their decodes shared steps
    assert engine.stats()["steps"] < steps_alone
    loop.close()


def test_visual_token_budget_holds_a_call_until_the_engine_has_room(ckpt, reqs, expected):
    first, second = reqs[:6], reqs[6:]
    engine = _engine(ckpt)
    loop = EngineLoop(engine, max_visual_tokens=100)
    submit, seen = engine.submit, []

    def logged(requests):
        requests = list(requests)
        seen.append((requests[0].id, engine.has_work))
        return submit(requests)

    engine.submit = logged
    late: dict = {}
    threads = []
    _on_first_step(engine, lambda: threads.append(_run_later(loop, second, late, visual_tokens=60)))
    early = loop.run(first, visual_tokens=60)  # 60 + 60 > 100: the second call waits for the first
    threads[0].join(timeout=120)
    assert seen == [(first[0].id, False), (second[0].id, False)]  # submitted only once the engine had drained
    assert {k: v.token_ids for k, v in {**early, **late}.items()} == expected
    loop.close()


def test_engine_failure_fails_what_it_held_and_the_loop_goes_on(ckpt, reqs, expected):
    engine = _engine(ckpt)
    loop = EngineLoop(engine, max_visual_tokens=10**6)
    step, calls = engine.step, []

    def flaky():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return step()

    engine.step = flaky
    failed = loop.run(reqs[:4])
    assert sorted(failed) == sorted(r.id for r in reqs[:4])
    assert {v.finish_reason for v in failed.values()} == {"error"}
    assert {v.error_type for v in failed.values()} == {"EngineError"}
    assert all("RuntimeError: device lost" in v.error for v in failed.values())
    assert not engine.has_work  # reset
    again = loop.run(reqs[:4])  # the same requests rerun to the tokens they give anywhere
    assert {k: v.token_ids for k, v in again.items()} == {r.id: expected[r.id] for r in reqs[:4]}
    loop.close()


def test_bad_calls_are_refused(ckpt, reqs):
    loop = EngineLoop(_engine(ckpt), max_visual_tokens=10)
    assert loop.run([]) == {}
    with pytest.raises(ValueError, match="distinct"):
        loop.run([reqs[0], reqs[0]])
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.run(reqs[:1])


def test_calls_are_submitted_only_while_the_waiting_queue_is_short(ckpt, reqs, expected):
    """Issue 33: queued calls go to the engine only while fewer than `lookahead` requests wait
    (or the engine is idle), so calls finish in about their order instead of all at the end."""
    engine = _engine(ckpt)
    loop = EngineLoop(engine, max_visual_tokens=10**6, lookahead=2)
    submit, seen = engine.submit, []

    def logged(requests):
        requests = list(requests)
        seen.append((engine.num_waiting, engine.has_work))
        return submit(requests)

    engine.submit = logged
    outs = [{} for _ in range(4)]
    threads = [_run_later(loop, reqs[k * 3:(k + 1) * 3], outs[k]) for k in range(4)]
    for t in threads:
        t.join(timeout=120)
    assert len(seen) == 4 and all(waiting < 2 or not busy for waiting, busy in seen), seen
    got = {k: v.token_ids for o in outs for k, v in o.items()}
    assert got == {k: v for k, v in expected.items() if k in got} and len(got) == 12
    assert EngineLoop(engine, max_visual_tokens=1).lookahead == engine.config.max_num_seqs  # the default
    loop.close()
