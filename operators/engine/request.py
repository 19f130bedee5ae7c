"""What goes into the engine (`Request`) and what comes out (`Result`).

A request is one prompt, already preprocessed: token ids, the media items whose
placeholder tokens it contains (pixel values, grid, content hash, the placeholder
positions), MRoPE position ids for the prompt and the rope delta that places generated
tokens (generated token at sequence index `i >= L` sits at position `i + rope_delta` on
all three axes, as transformers' generate does). `Request.from_processor` builds one
from the processor's output (ours or transformers').
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import torch

from vlbatch.operators.engine.media_spans import MediaItem, as_tensor, split_media
from vlbatch.operators.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings with transformers' generate semantics.

    Greedy when `do_sample` is False (repetition penalty still applies, as in generate).
    When sampling: repetition penalty, then temperature, top-k, top-p, then a draw from a
    per-request `torch.Generator` seeded with `seed` (reproducible whatever the batch).
    `stop_token_ids=None` means the checkpoint's eos ids (generation_config.json).
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise InputError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not s for s in self.stop_strings):
            raise InputError("stop_strings must be non-empty strings")


@dataclass(frozen=True)
class ResponseFormat:
    """What a constrained answer must be (`operators/engine/grammar.py` decodes it).

    kind: "json_schema" (spec: the schema as JSON text), "choice" (spec: a JSON list of the
    strings) or "regex" (spec: the pattern). Two equal formats share one compiled grammar (`key`).
    name: the question (prompt name) it constrains, named in its errors; not part of the format.
    """

    kind: Literal["json_schema", "choice", "regex"]
    spec: str
    name: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in ("json_schema", "choice", "regex"):
            raise InputError(f"response format type {self.kind!r}: allowed json_schema, choice, regex")

    @property
    def key(self) -> str:
        """sha256 of kind and spec: the compiled-grammar cache key."""
        return hashlib.sha256(f"{self.kind}\x1f{self.spec}".encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class Request:
    """One prompt for the engine.

    prompt_token_ids: the L prompt tokens (placeholders included).
    position_ids:     [3, L] int64 MRoPE positions of the prompt (get_rope_index's).
    rope_delta:       generated token i (i >= L) is at position i + rope_delta.
    group:            optional sibling key; requests sharing a prefix are found
                      automatically, `group` only keeps siblings adjacent in the queue.
    thinking:         the prompt ends in a thinking generation prompt; the text before
                      `</think>` goes to `Result.thinking`.
    response_format:  the answer is constrained to it (after `</think>` when thinking); None = free text.
    """

    id: str
    prompt_token_ids: tuple[int, ...]
    position_ids: torch.Tensor
    rope_delta: int = 0
    media: tuple[MediaItem, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group: str | None = None
    thinking: bool = False
    response_format: ResponseFormat | None = None

    def __post_init__(self):
        n = len(self.prompt_token_ids)
        if n < 1:
            raise InputError(f"request {self.id!r}: empty prompt")
        if tuple(self.position_ids.shape) != (3, n):
            raise InputError(f"request {self.id!r}: position_ids must be [3, {n}], "
                             f"got {tuple(self.position_ids.shape)}")
        for m in self.media:
            if any(s < 0 or e > n or s >= e for s, e in m.spans):
                raise InputError(f"request {self.id!r}: media span outside the prompt: {m.spans}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def visual_tokens(self) -> int:
        return sum(m.num_tokens for m in self.media)

    @classmethod
    def from_processor(cls, id: str, out: dict, index: int = 0, *, sampling: SamplingParams | None = None,
                       group: str | None = None, thinking: bool = False, merge_size: int = 2,
                       temporal_patch_size: int = 2) -> Request:
        """Build the `index`-th prompt of a processor output (numpy or torch values).

        Needs input_ids, mm_token_type_ids (when media are present), pixel_values /
        image_grid_thw, pixel_values_videos / video_grid_thw, position_ids [3, B, L] and
        rope_deltas [B] or [B, 1]. Padding (attention_mask == 0) is removed. The float patches
        become the engine's one media form here (`split_media`, exact; `temporal_patch_size` is
        the processor's, 2 for every Qwen3.5 checkpoint).
        """
        ids = as_tensor(out["input_ids"])
        if "attention_mask" in out:
            keep = as_tensor(out["attention_mask"])[index].bool()
        else:
            keep = torch.ones_like(ids[index]).bool()
        types = as_tensor(out["mm_token_type_ids"]) if "mm_token_type_ids" in out else torch.zeros_like(ids)
        media = split_media(ids, types, out, index, keep, merge_size, temporal_patch_size)
        pos = as_tensor(out["position_ids"])[:, index][:, keep].to(torch.int64).contiguous()
        delta = int(as_tensor(out["rope_deltas"]).reshape(-1)[index])
        return cls(id=id, prompt_token_ids=tuple(int(x) for x in ids[index][keep]), position_ids=pos,
                   rope_delta=delta, media=media, sampling=sampling or SamplingParams(), group=group,
                   thinking=thinking)



THINK_END = "</think>"


def split_thinking(text: str) -> tuple[str, str]:
    """(thinking, answer) of the text generated after a thinking generation prompt.

    Qwen3.5's chat template opens the thinking block in the prompt (`<think>\n`), so the
    output is thinking up to the first `</think>` and the answer after it, both stripped.
    Without `</think>` the block never closed (the budget ran out while thinking): all of
    the text is thinking and the answer is empty, as transformers' response parsing reads
    an output whose prompt opened the block (the region stays open to the end).
    """
    head, sep, tail = text.partition(THINK_END)
    return (head.strip(), tail.strip()) if sep else (text.strip(), "")


@dataclass(frozen=True)
class Timings:
    """Seconds from `generate` receiving the request: admitted, first token, finished."""

    queued_s: float
    first_token_s: float
    total_s: float


@dataclass(frozen=True)
class Result:
    """One finished request.

    text:       the answer (after `</think>` when the request has `thinking`, see
                `split_thinking`), special tokens skipped, cut before a matched stop string.
    thinking:   the reasoning text before `</think>` (None when thinking is off).
    token_ids:  every generated token, the final stop token included.
    finish_reason: "stop" (stop token or stop string), "length" (max_new_tokens) or
                "error" (`error` says why, `error_type` names the vlbatch.operators.errors class;
                the request could not run, nothing crashed).
    cached_tokens: prompt tokens served by the prefix cache.
    out_of_memory: an error result of a step that ran out of memory (torch's OutOfMemoryError or
                MemoryError): the request may fit in a smaller batch (the model stage retries it so).
    parsed:     a constrained request's complete value as JSON text (`grammar.parse_answer`), else None.
    truncated:  a constrained request stopped (max_new_tokens) before its value was complete:
                `parsed` is None and the row is a `TruncatedError`, never a half-parsed value.
    """

    id: str
    token_ids: tuple[int, ...]
    text: str
    thinking: str | None
    finish_reason: str
    prompt_tokens: int
    visual_tokens: int
    generated_tokens: int
    cached_tokens: int
    timings: Timings
    error: str | None = None
    error_type: str | None = None  # vlbatch.operators.errors class name for error rows ("InputError": will fail again)
    out_of_memory: bool = False
    parsed: str | None = None
    truncated: bool = False

    @classmethod
    def failed(cls, req: Request, message: str, error_type: str, timings: Timings,
               out_of_memory: bool = False) -> Result:
        """The error result of a request that produced nothing."""
        return cls(id=req.id, token_ids=(), text="", thinking=None, finish_reason="error",
                   prompt_tokens=req.prompt_len, visual_tokens=req.visual_tokens, generated_tokens=0,
                   cached_tokens=0, timings=timings, error=message, error_type=error_type,
                   out_of_memory=out_of_memory)
