"""Constrained decoding in the engine (issue 52) on a random tiny checkpoint, where nearly every token
is likely: the grammar, not the model, makes each answer valid.

Every finished constrained answer parses and validates (the `jsonschema` library); a choice answer is
one of the choices, a regex answer matches; unconstrained requests in a mixed batch get exactly the
tokens of a run without constraints; the prefix cache on and off give the same constrained tokens; a
budget too small for the value is `truncated` (no parsed value); one compilation per distinct format.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
from test_engine_support import image, request

from vlbatch.operators.engine.request import ResponseFormat
from vlbatch.operators.factory import load_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "properties": {
    "shape": {"enum": ["circle", "square", "triangle"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 20},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    "text": {"type": "boolean"}}, "required": ["shape", "count", "tags", "text"], "additionalProperties": False}
CHOICES = ["yes", "no", "not sure"]
PATTERN = "[12][0-9]{3}"
JSON_FMT = ResponseFormat("json_schema", json.dumps(SCHEMA))
CHOICE_FMT = ResponseFormat("choice", json.dumps(CHOICES))
REGEX_FMT = ResponseFormat("regex", PATTERN)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("dense")


@pytest.fixture(scope="module")
def plain(ckpt):
    """12 unconstrained prompts (4 images x 3 questions), greedy and sampled."""
    out = []
    for i in range(12):
        kw = {"do_sample": True, "temperature": 1.5, "seed": i} if i % 2 else {}
        out.append(request(ckpt, f"p{i}", [("image", image(i % 4)), f"Question {i}?"], max_new_tokens=12, **kw))
    return out


def _constrained(reqs, fmts, max_new_tokens=160):
    """The same prompts with formats (a new id each), room for a whole value."""
    return [replace(r, id=f"c{i}", response_format=f, sampling=replace(r.sampling, max_new_tokens=max_new_tokens))
            for i, (r, f) in enumerate(zip(reqs, fmts, strict=False))]


def _run(ckpt, reqs, **kw):
    engine = load_engine(ckpt, kv_budget_bytes=16 << 20, **kw)
    return {r.id: r for r in engine.generate(reqs)}, engine.stats()


def _check_valid(res, fmt):
    assert res.finish_reason == "stop" and not res.truncated, res
    value = json.loads(res.parsed)
    if fmt.kind == "json_schema":
        jsonschema.validate(value, json.loads(fmt.spec))
        assert json.loads(res.text, strict=False) == value  # (grammar.parse_answer: raw control chars)
    elif fmt.kind == "choice":
        assert value == res.text and value in json.loads(fmt.spec)
    else:
        assert value == res.text and re.fullmatch(fmt.spec, value)


@pytest.mark.slow
def test_every_constrained_answer_is_valid_and_unconstrained_rows_are_untouched(ckpt, plain):
    fmts = [JSON_FMT, CHOICE_FMT, REGEX_FMT] * 4
    constrained = _constrained(plain, fmts)
    alone, stats0 = _run(ckpt, plain)
    assert stats0["grammar_compilations"] == 0  # unconstrained work compiles nothing
    mixed, stats = _run(ckpt, [x for pair in zip(plain, constrained, strict=True) for x in pair])
    for r in plain:  # same tokens as without constraints beside them (greedy and seeded sampling)
        assert mixed[r.id].token_ids == alone[r.id].token_ids and mixed[r.id].parsed is None
    for r in constrained:
        _check_valid(mixed[r.id], r.response_format)
    assert stats["grammar_compilations"] == 3  # one per distinct format, 12 requests


@pytest.mark.slow
def test_prefix_cache_on_equals_off_for_constrained(ckpt, plain):
    reqs = _constrained(plain[:6], [JSON_FMT, CHOICE_FMT, REGEX_FMT] * 2)
    on, _ = _run(ckpt, reqs)
    off, _ = _run(ckpt, reqs, prefix_cache_bytes=0)
    chunked, _ = _run(ckpt, reqs, max_num_batched_tokens=16, chunk_size=16)
    for r in reqs:
        assert on[r.id].token_ids == off[r.id].token_ids == chunked[r.id].token_ids
        _check_valid(on[r.id], r.response_format)


@pytest.mark.slow
def test_a_value_cut_by_max_tokens_is_truncated_with_no_parsed_value(ckpt, plain):
    reqs = _constrained(plain[:2], [JSON_FMT, REGEX_FMT], max_new_tokens=2)
    out, _ = _run(ckpt, reqs)
    for r in reqs:
        res = out[r.id]
        assert res.finish_reason == "length" and res.truncated and res.parsed is None, res


@pytest.mark.slow
def test_a_format_the_grammar_engine_refuses_is_an_error_result(ckpt, plain):
    bad = replace(plain[0], id="bad", response_format=ResponseFormat("regex", "[12"))
    out, _ = _run(ckpt, [bad, plain[1]])
    assert out["bad"].finish_reason == "error" and out["bad"].error_type == "InputError"
    assert "regex" in out["bad"].error and out[plain[1].id].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_thinking_grammar_starts_after_the_thinking_block(ckpt):
    """Unit level: a thinking request's matcher is inactive (its row unmasked) until `</think>` is
    generated, then constrains; the tiny model rarely writes `</think>` itself."""
    import torch

    from vlbatch.operators.engine.grammar import GrammarBook
    from vlbatch.operators.preprocess.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    book = GrammarBook(tok, 832, (774,))
    state = book.state(CHOICE_FMT, (774,), thinking=True)
    logits = torch.zeros(2, 832)
    assert not state.active and book.mask_logits(logits, [state, None]) is logits  # free while thinking
    state.accept(tok.backend.token_to_id("a"))
    assert not state.active
    state.accept(tok.backend.token_to_id("</think>"))
    masked = book.mask_logits(logits, [None, state])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and all(any(c.startswith(tok.decode([t])) for c in CHOICES) for t in allowed)
    assert torch.isfinite(masked[0]).all()  # the unconstrained row untouched
    for t in tok.backend.encode("not sure", add_special_tokens=False).ids:
        state.accept(t)
    assert state.complete and not state.terminated
    state.accept(774)
    assert state.terminated and book.compilations == 1


@pytest.mark.slow
def test_no_stop_token_ends_a_whole_value(ckpt, plain):
    """With no stop token (stop_token_ids=()) nothing could end the value: the request finishes at a whole value."""
    reqs = [replace(r, sampling=replace(r.sampling, stop_token_ids=())) for r in _constrained(plain[:2],
                                                                                              [CHOICE_FMT, REGEX_FMT])]
    out, _ = _run(ckpt, reqs)
    for r in reqs:
        _check_valid(out[r.id], r.response_format)


def _tp_rank(rank: int, world: int, cases: list) -> list:
    from vlbatch.operators.parallel.replica import follow_pretrained

    out = []
    for ckpt, reqs in cases:
        if rank == 0:
            engine = load_engine(ckpt, tensor_parallel_size=world, kv_budget_bytes=16 << 20)
            out.append({r.id: (r.token_ids, r.parsed) for r in engine.generate(reqs)})
            engine.close()
        else:
            out.append(follow_pretrained(ckpt, world, False, kv_budget_bytes=16 << 20))
    return out


@pytest.mark.slow
def test_tp2_replica_decodes_the_same_constrained_tokens(ckpt, plain):
    """Rank 0 samples (and holds the matchers); a 2-rank replica gives one rank's tokens and values."""
    from parallel_support import run_ranks

    reqs = _constrained(plain[:4], [JSON_FMT, CHOICE_FMT, REGEX_FMT, JSON_FMT])
    got = run_ranks(_tp_rank, 2, [(str(ckpt), reqs)])[0][0]
    want, _ = _run(ckpt, reqs)
    for r in reqs:
        assert got[r.id] == (want[r.id].token_ids, want[r.id].parsed)
        _check_valid(want[r.id], r.response_format)


@pytest.mark.slow
def test_an_unconstrained_run_never_imports_the_grammar_engine(ckpt, plain):
    """No constrained row: no grammar work and no xgrammar import (the GPU device env has none), in a
    fresh interpreter where nothing imported it before."""
    import subprocess
    import sys

    code = ("import sys, pickle; from vlbatch.operators.factory import load_engine; "
            "reqs = pickle.loads(sys.stdin.buffer.read()); "
            "engine = load_engine(sys.argv[1], kv_budget_bytes=16 << 20); "
            "out = list(engine.generate(reqs)); "
            "assert len(out) == len(reqs) and all(r.finish_reason for r in out); "
            "print('xgrammar' in sys.modules)")
    import pickle

    done = subprocess.run([sys.executable, "-c", code, str(ckpt)], input=pickle.dumps(plain[:2]),
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode().strip().splitlines()[-1] == "False", done.stderr.decode()[-2000:]
