"""Sampler (against transformers' logits processors); paged attention is tests/test_kernels_attention.py."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlbatch.operators.engine.request import SamplingParams
from vlbatch.operators.engine.sampler import make_generator, repetition_penalty, sample, warp


@pytest.mark.parametrize("temp,top_k,top_p,pen", [(0.7, 5, 0.9, 1.3), (1.3, None, 0.5, None), (1.0, 3, None, 0.8),
                                                  (0.5, 50, 0.99, 1.1)])
def test_processing_equals_transformers(temp, top_k, top_p, pen):
    torch.manual_seed(0)
    logits = torch.randn(1, 97) * 3
    hist = torch.randint(0, 97, (1, 20))
    ref = logits.clone()
    if pen:
        ref = RepetitionPenaltyLogitsProcessor(pen)(hist, ref)
    ref = TemperatureLogitsWarper(temp)(hist, ref) if temp != 1.0 else ref
    ref = TopKLogitsWarper(top_k)(hist, ref) if top_k else ref
    ref = TopPLogitsWarper(top_p)(hist, ref) if top_p else ref
    p = SamplingParams(do_sample=True, temperature=temp, top_k=top_k, top_p=top_p, repetition_penalty=pen)
    ours = repetition_penalty(logits[0], hist[0], pen) if pen else logits[0]
    ours = warp(ours, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref[0]))
    torch.testing.assert_close(ours[~torch.isinf(ours)], ref[0][~torch.isinf(ref[0])])


def test_seeded_draws_match_global_rng_and_ignore_batch_company():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    p = SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=1234)
    alone = [sample(logits[2:3], [p], [None], [g]) for g in [make_generator(p, "cpu")]][0]
    torch.manual_seed(1234)  # what generate does with a global seed, batch of one
    probs = warp(logits[2], p).softmax(-1)
    assert alone[0] == int(torch.multinomial(probs[None], 1)[0, 0])
    # the same request inside batches of other sampling requests draws the same tokens
    gen_a, gen_b = make_generator(p, "cpu"), make_generator(p, "cpu")
    others = [SamplingParams(do_sample=True, seed=s) for s in range(5)]
    other_gens = [make_generator(o, "cpu") for o in others]
    seq_a, seq_b = [], []
    for step in range(5):
        seq_a += sample(logits[2:3], [p], [None], [gen_a])
        batch = torch.cat([torch.randn(step, 50), logits[2:3]])
        seq_b += sample(batch, others[:step] + [p], [None] * (step + 1), other_gens[:step] + [gen_b])[-1:]
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_greedy_batch_and_penalised_rows():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 2.9, -1.0]])
    greedy = SamplingParams()
    pen = SamplingParams(repetition_penalty=2.0)
    out = sample(logits, [greedy, pen], [None, torch.tensor([0])], [None, None])
    assert out == [1, 1]  # row 2: 3.0 / 2 = 1.5 < 2.9
