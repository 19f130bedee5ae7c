"""Next-token choice with transformers' generate semantics, one generator per request.

Order (transformers `_get_logits_processor`): repetition penalty on the float32 logits
over prompt + generated ids (greedy too), then, only when sampling, temperature, top-k,
top-p (`TopPLogitsWarper`: drop the low tail whose cumulative probability is <= 1 - p,
always keep the best token), softmax and one `torch.multinomial` draw from the
request's own `torch.Generator`, so a seeded request draws the same tokens whatever else
is in the batch. Greedy rows without a penalty are argmax'ed together.
"""
from __future__ import annotations

import os

import torch

from vlbatch.operators.engine.request import SamplingParams


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    """The request's generator (None for greedy); unseeded requests get a random seed."""
    if not params.do_sample:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
    return torch.Generator(device=device).manual_seed(seed)


def repetition_penalty(logits: torch.Tensor, token_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [V], token_ids [N]: seen tokens' logits divided by penalty (multiplied if negative)."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[token_ids[token_ids < logits.shape[-1]]] = True
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p on one row [V] (masked entries -inf)."""
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - params.top_p)
        remove_sorted[-1] = False
        remove = remove_sorted.scatter(0, idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], histories: list[torch.Tensor | None],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [n, V] (any float dtype); returns one token id per row.

    histories[i]: prompt + generated ids of row i (needed only with a repetition penalty).
    """
    logits = logits.float()
    plain = [i for i, p in enumerate(params) if not p.do_sample and not p.repetition_penalty]
    if len(plain) == len(params):  # every row greedy (a captioning job): one argmax, no row gather
        return logits.argmax(-1).tolist()
    out: list[int | None] = [None] * len(params)
    if plain:
        ids = logits[plain].argmax(-1).tolist()
        for i, t in zip(plain, ids, strict=False):
            out[i] = t
    for i, p in enumerate(params):
        if out[i] is not None:
            continue
        row = logits[i]
        if p.repetition_penalty and p.repetition_penalty != 1.0:
            row = repetition_penalty(row, histories[i], p.repetition_penalty)
        if not p.do_sample:
            out[i] = int(row.argmax())
            continue
        probs = warp(row, p).softmax(-1)
        out[i] = int(torch.multinomial(probs.unsqueeze(0), 1, generator=generators[i])[0, 0])
    return out
