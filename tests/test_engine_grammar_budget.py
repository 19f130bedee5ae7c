"""Response formats under the grammar budget (issue 60, item 2) on a random tiny checkpoint.

A format's grammar compiles off the engine loop's thread, in a child process killed at
`grammar_compile_s`: a format past it (a JSON schema of a 60,000-value enum, about ten seconds to
compile even at the tiny checkpoint's 832 tokens) or over `grammar_max_bytes` is an InputError result for
its own requests, naming the question and the budget; the other requests, constrained or not, finish.
A second request for a format in flight or refused never starts a second compile. While a format
compiles (held by an Event the test controls, the real compile after it) the loop keeps decoding the
other calls' requests.
"""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
from test_engine_support import image, request

from vlbatch.operators.engine.loop import EngineLoop
from vlbatch.operators.engine.request import ResponseFormat
from vlbatch.operators.factory import load_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHOICES = ["yes", "no"]
CHOICE = ResponseFormat("choice", json.dumps(CHOICES), "has_text")
SLOW_SPEC = json.dumps({"enum": [f"v{i:06d}x" for i in range(60_000)]})  # ~720 KB; seconds to compile
SLOW = ResponseFormat("json_schema", SLOW_SPEC, "tags")
SLOW_TOO = ResponseFormat("json_schema", SLOW_SPEC, "labels")  # another question, the same format
HUGE = ResponseFormat("regex", "a" * ((1 << 20) + 1), "huge")  # over the 1 MiB max_bytes below


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("dense")


def _requests(ckpt, formats: list[ResponseFormat | None]) -> list:
    out = []
    for i, fmt in enumerate(formats):
        r = request(ckpt, f"r{i}", [("image", image(i % 2)), f"Question {i}?"], max_new_tokens=8)
        out.append(replace(r, response_format=fmt, sampling=replace(r.sampling, max_new_tokens=16)))
    return out


def _counted(engine) -> list[str]:
    """The keys of the formats the engine compiles (the real compile, counted)."""
    calls: list[str] = []

    def compile_fn(fmt):
        calls.append(fmt.key)
        return engine.grammars.compile_in_child(fmt)

    engine.grammars.compile_fn = compile_fn
    return calls


@pytest.mark.slow
def test_a_format_past_the_budget_is_an_error_for_its_question_only(ckpt):
    engine = load_engine(ckpt, kv_budget_bytes=16 << 20, grammar_compile_s=1.0, grammar_max_bytes=1 << 20)
    calls = _counted(engine)
    reqs = _requests(ckpt, [CHOICE, None, SLOW, HUGE, SLOW_TOO, None])
    out = {r.id: r for r in engine.generate(reqs)}
    assert len(out) == len(reqs)
    for rid, question in (("r2", "tags"), ("r4", "labels")):
        res = out[rid]
        assert res.finish_reason == "error" and res.error_type == "InputError", res
        assert res.error.startswith(f"question {question!r}: ") and "1 s" in res.error \
            and "model.engine.grammar.compile_s" in res.error, res.error
    huge = out["r3"]
    assert huge.error_type == "InputError" and "question 'huge'" in huge.error \
        and "model.engine.grammar.max_bytes" in huge.error, huge
    assert json.loads(out["r0"].parsed) in CHOICES and out["r0"].finish_reason == "stop", out["r0"]
    for rid in ("r1", "r5"):
        assert out[rid].finish_reason in ("stop", "length") and out[rid].error is None, out[rid]
    assert sorted(calls) == sorted({CHOICE.key, SLOW.key})  # once each; the oversized one never compiled
    assert engine.stats()["grammar_compilations"] == 1
    again = {r.id: r for r in engine.generate(_requests(ckpt, [SLOW]))}  # refused once: refused again at once
    assert again["r0"].error_type == "InputError" and len(calls) == 2
    engine.grammars.close()


@pytest.mark.slow
def test_the_loop_decodes_other_requests_while_a_format_compiles(ckpt):
    engine = load_engine(ckpt, kv_budget_bytes=16 << 20)
    started, release = threading.Event(), threading.Event()

    def held(fmt):  # the compile waits for the test, then runs for real
        started.set()
        release.wait()
        return engine.grammars.compile_in_child(fmt)

    engine.grammars.compile_fn = held
    loop = EngineLoop(engine, max_visual_tokens=1 << 20)
    constrained, *plain = _requests(ckpt, [CHOICE, None, None, None])
    got: dict = {}
    caller = threading.Thread(target=lambda: got.update(loop.run([constrained])), daemon=True)
    caller.start()
    while not started.wait(0.1):  # the event: the compile began (a call that ends first never used it)
        assert caller.is_alive(), f"the constrained call ended without its compile: {got}"
    others = loop.run(plain)  # another call, while the compile is held
    assert all(r.finish_reason in ("stop", "length") and r.error is None for r in others.values()), others
    assert caller.is_alive() and not got  # still waiting for its grammar
    release.set()
    caller.join()
    assert json.loads(got[constrained.id].parsed) in CHOICES, got
    loop.close()
    engine.grammars.close()
