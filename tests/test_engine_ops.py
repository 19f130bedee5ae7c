"""Sampler (against transformers' logits processors) and paged attention (against the naive reference)."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlbatch.operators.engine.paged_attention import PagedLayout, attention_naive, paged_attention
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


def _paged_case(rng, lens, block_size, n_blocks, hq, hkv, d):
    """Random caches, block tables with shuffled blocks, one chunk per sequence."""
    blocks = list(range(n_blocks))
    rng.shuffle(blocks)
    tables, starts, ends, _hist_k, _hist_v = [], [], [], [], []
    kc = torch.randn(n_blocks, block_size, hkv, d)
    vc = torch.randn(n_blocks, block_size, hkv, d)
    for past, new in lens:
        need = -(-(past + new) // block_size)
        tables.append([blocks.pop() for _ in range(need)])
        starts.append(past)
        ends.append(past + new)
    return tables, starts, ends, kc, vc


@pytest.mark.parametrize("block_size,hq,hkv,d", [(4, 4, 2, 8), (3, 6, 3, 5), (16, 2, 2, 7)])
def test_paged_attention_matches_naive_on_odd_shapes(block_size, hq, hkv, d):
    rng = random.Random(block_size)
    lens = [(0, 7), (5, 1), (13, 1), (9, 4), (0, 1), (2, 11)]  # (cached, new): prefills and decodes mixed
    tables, starts, ends, kc, vc = _paged_case(rng, lens, block_size, 64, hq, hkv, d)
    t = sum(e - s for s, e in zip(starts, ends, strict=False))
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    layout = PagedLayout.build(tables, starts, ends, block_size, "cpu")
    out = paged_attention(layout, kc, vc, q, k, v)
    row = 0
    for table, s, e in zip(tables, starts, ends, strict=False):
        pos = torch.arange(e)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k_all, v_all = kc.view(-1, hkv, d)[slots], vc.view(-1, hkv, d)[slots]
        assert torch.equal(k_all[s:], k[row: row + e - s])  # new K/V were written at their slots
        ref = attention_naive(q[row: row + e - s], k_all, v_all)
        torch.testing.assert_close(out[row: row + e - s].double(), ref, atol=1e-5, rtol=1e-5)
        row += e - s


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_rows_equal_the_full_rows(block_size):
    """With `rows`, queries of those rows only (any mix of decode and prefill chunks) give
    the same outputs as the full call, and all new K/V are still stored."""
    rng = random.Random(block_size)
    lens = [(0, 7), (5, 1), (13, 1), (9, 4), (0, 1), (2, 11)]
    tables, starts, ends, kc, vc = _paged_case(rng, lens, block_size, 64, 4, 2, 8)
    t = sum(e - s for s, e in zip(starts, ends, strict=False))
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    layout = PagedLayout.build(tables, starts, ends, block_size, "cpu")
    full = paged_attention(layout, kc.clone(), vc.clone(), q, k, v)
    rows = torch.tensor([0, 6, 8, 9, 12, 14, 20])  # chunk ends, a chunk's middle row, its first row
    kc2, vc2 = kc.clone(), vc.clone()
    part = paged_attention(layout, kc2, vc2, q[rows], k, v, rows)
    torch.testing.assert_close(part, full[rows], atol=1e-6, rtol=1e-5)
    assert torch.equal(kc2.view(-1, 2, 8)[layout.slot_mapping], k)
