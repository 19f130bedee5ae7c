"""Every prefill form the delta-rule tuner may pick (`tuning.CANDIDATES`) against the naive
loop over odd shapes, float32 within 1e-5; the tuner picks one of them once and keeps it."""
from __future__ import annotations

import pytest
import torch

from vlbatch.operators.kernels.delta_rule.naive import NaiveDeltaRule
from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule
from vlbatch.operators.kernels.delta_rule.tuning import CANDIDATES, PrefillTuner, probe_problem, run_form

TOL = 1e-5


@pytest.mark.parametrize("form", CANDIDATES)
@pytest.mark.parametrize(("h", "dk", "dv", "lens"), [(3, 7, 5, (1, 17, 2)), (1, 64, 64, (70,)),
                                                      (2, 16, 33, (33, 1, 64, 15, 100)), (5, 4, 6, (3,) * 9)])
def test_every_candidate_equals_naive_and_leaves_the_state(form, h, dk, dv, lens):
    q, k, v, g, beta, state, lens = probe_problem(h, dk, dv, lens, seed=sum(lens) + h)
    before = state.clone()
    o_ref, s_ref = NaiveDeltaRule().prefill(q, k, v, g, beta, state, lens)
    o, s = run_form(form, q, k, v, g, beta, state, lens)
    assert torch.equal(state, before)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape and s.dtype == torch.float32
    assert (o - o_ref).abs().max() < TOL and (s - s_ref).abs().max() < TOL


@pytest.mark.parametrize("form", CANDIDATES)
def test_every_candidate_on_strong_decay_and_bf16_values(form):
    q, k, v, g, beta, state, lens = probe_problem(2, 8, 8, (19, 40), seed=5)
    g = g * 200  # exp(g) far below float32's range: the floors must not turn into nan
    o_ref, s_ref = NaiveDeltaRule().prefill(q, k, v, g, beta, state, lens)
    o, s = run_form(form, q, k, v.bfloat16(), g, beta, state, lens)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()
    o32, s32 = run_form(form, q, k, v, g, beta, state, lens)
    assert (o32 - o_ref).abs().max() < TOL and (s32 - s_ref).abs().max() < TOL


def test_the_tuner_times_every_candidate_once_and_keeps_its_choice():
    tuner = PrefillTuner()
    q, k, v, g, beta, state, lens = probe_problem(2, 8, 8, (5, 3))
    form = tuner.choose(q, v)
    assert form in CANDIDATES and set(tuner.timings) == set(CANDIDATES)
    tuner.timings.clear()
    assert tuner.choose(q, v) == form and not tuner.timings  # not timed again
    assert form in tuner.describe()
    again = PrefillTuner()
    assert again.choose(q, v) == form and set(again.timings) == set(CANDIDATES)  # once per process
    with pytest.raises(ValueError, match="unknown"):
        run_form("gemm", q, k, v, g, beta, state, lens)


def test_the_torch_kernels_run_the_tuned_form_unless_a_chunk_is_given():
    q, k, v, g, beta, state, lens = probe_problem(3, 8, 8, (9, 30))
    o_ref, _ = NaiveDeltaRule().prefill(q, k, v, g, beta, state, lens)
    tuned = TorchDeltaRule()
    o, _ = tuned.prefill(q, k, v, g, beta, state, lens)
    assert tuned.tuner.form in CANDIDATES and (o - o_ref).abs().max() < TOL
    fixed = TorchDeltaRule(chunk_size=16)
    o16, _ = fixed.prefill(q, k, v, g, beta, state, lens)
    assert fixed.tuner.form is None and (o16 - o_ref).abs().max() < TOL
