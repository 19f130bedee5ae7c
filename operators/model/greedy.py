"""Reference greedy decoding with the model's own `ContiguousCache` (tests and benchmarks).

The engine owns real generation (scheduling, sampling, stop rules); this loop is the
simplest correct use of `forward(..., cache=...)`: one prefill call, then one token per
sequence per call, always the argmax.
"""
from __future__ import annotations

import torch

from vlbatch.operators.model.contiguous_cache import ContiguousCache
from vlbatch.operators.model.model import Qwen35Model


@torch.inference_mode()
def greedy_generate(
    model: Qwen35Model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_ids: tuple[int, ...] = (),
    **media,
) -> torch.Tensor:
    """input_ids [B, L] (+ pixel_values / grids / mm_token_type_ids) -> new tokens [B, n <= max_new_tokens].

    Stops early once every sequence has produced one of `eos_token_ids` (later tokens of
    finished sequences are still computed but not reported past their eos).
    """
    b, length = input_ids.shape
    cache = ContiguousCache(
        model.config.text, b, device=model.device, dtype=model.dtype, capacity=length + max_new_tokens
    )
    logits = model(input_ids, cache=cache, logits_to_keep=1, **media)
    tokens = []
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=input_ids.device)
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)  # [B]
        tokens.append(nxt)
        done |= torch.isin(nxt, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(nxt[:, None], cache=cache, logits_to_keep=1)
    return torch.stack(tokens, dim=1)
