"""Chat-template rendering, placeholder expansion and tokenisation.

Owns the token ids of a prompt. The text is rendered by the checkpoint's own
chat template (chat_template.jinja) through the checkpoint's tokenizer. Each
`<|image_pad|>` then stands for `T*H*W / merge^2` image tokens, and each
`<|video_pad|>` for, per temporal group g, `<{t_g:.1f} seconds>` +
`<|vision_start|>` + `H*W / merge^2` video tokens + `<|vision_end|>`, exactly
the strings transformers' Qwen3VLProcessor substitutes.

Instead of tokenising the expanded string (thousands of pad tokens), we tokenise
the short rendered prompt once and splice the expansion in at the placeholder
ids. This gives the same ids because the placeholders and vision markers are
special added tokens: the tokenizer splits text at them before any merge, so
the text on each side (and each timestamp string, which sits between two
special tokens) is tokenised on its own either way. The parity tests compare
with the reference's full-string tokenisation.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import InputError, SetupError

CACHE_ENTRIES = 8192  # per cache: long-lived workers see many distinct strings; a full cache starts over


def cached(cache: dict, key, make):
    """`cache[key]`, made by `make()` on a miss; the cache is cleared when it reaches CACHE_ENTRIES."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= CACHE_ENTRIES:
            cache.clear()
        value = cache[key] = make()
    return value


@dataclass(frozen=True)
class SpecialTokens:
    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int
    pad: int

    @classmethod
    def from_tokenizer(cls, tok) -> SpecialTokens:
        def tid(text: str) -> int:
            i = tok.convert_tokens_to_ids(text)
            if i is None or i == tok.unk_token_id:
                raise InputError(f"tokenizer has no {text} token")
            return int(i)

        pad = tok.pad_token_id if tok.pad_token_id is not None else tid("<|endoftext|>")
        return cls(tid("<|image_pad|>"), tid("<|video_pad|>"), tid("<|vision_start|>"), tid("<|vision_end|>"), pad)


class PromptEncoder:
    """Renders chat messages and encodes prompts with expanded vision placeholders."""

    def __init__(self, tokenizer, chat_template: str | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tokens = SpecialTokens.from_tokenizer(tokenizer)
        self._stamp_ids: dict[str, list[int]] = {}  # "<1.2 seconds>" -> ids (per-instance cache)
        # rendered prompt -> its ids before expansion: a job asks the same few prompts of every media
        self._text_ids: dict[str, tuple[int, ...]] = {}
        # ids of added tokens: the tokenizer splits text at each of them
        self._split = frozenset(int(i) for i in tokenizer.added_tokens_decoder)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               enable_thinking: bool = False, **template_kwargs) -> str:
        """The prompt string the checkpoint's chat template renders for `messages`."""
        if not messages:
            raise InputError("messages is empty: give at least one chat message")
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **template_kwargs)
        except SetupError:  # no chat template: the checkpoint's fault, not the messages'
            raise
        except Exception as e:  # jinja raise_exception / TemplateError: bad messages, not a bug here
            raise InputError(f"chat template rejected the messages: {e}") from e

    def _stamp(self, seconds: float) -> list[int]:
        text = f"<{seconds:.1f} seconds>"
        return cached(self._stamp_ids, text, lambda: self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _ids(self, texts: list[str]) -> list[tuple[int, ...]]:
        """Token ids of each rendered text (special tokens added); unseen texts are tokenised in one call."""
        missing = [t for t in dict.fromkeys(texts) if t not in self._text_ids]
        if missing:
            if len(self._text_ids) + len(missing) > CACHE_ENTRIES:
                self._text_ids.clear()
            for t, ids in zip(missing, self.tokenizer(missing, add_special_tokens=True)["input_ids"], strict=True):
                self._text_ids[t] = tuple(ids)
        return [self._text_ids[t] for t in texts]

    def video_ids(self, tokens_per_group: int, timestamps: tuple[float, ...]) -> list[int]:
        """The ids replacing one `<|video_pad|>`."""
        t = self.tokens
        frame = [t.vision_start] + [t.video_pad] * tokens_per_group + [t.vision_end]
        out: list[int] = []
        for s in timestamps:
            out += self._stamp(s) + frame
        return out

    def _video_text(self, tokens_per_group: int, timestamps: tuple[float, ...]) -> str:
        frame = "<|vision_start|>" + "<|video_pad|>" * tokens_per_group + "<|vision_end|>"
        return "".join(f"<{s:.1f} seconds>" + frame for s in timestamps)

    def encode(self, texts: list[str], images: list[int], videos: list[tuple[int, tuple[float, ...]]]) -> list[list[int]]:
        """Token ids of each text with placeholders expanded.

        images: pad-token count of each image, in prompt order across `texts`;
        videos: (pad tokens per temporal group, group timestamps) of each video.
        Raises `InputError` when placeholders and media counts disagree.
        """
        t = self.tokens
        encoded = self._ids(texts)
        n_img = sum(ids.count(t.image_pad) for ids in encoded)
        n_vid = sum(ids.count(t.video_pad) for ids in encoded)
        if n_img != len(images) or n_vid != len(videos):
            raise InputError(
                f"the prompt has {n_img} image and {n_vid} video placeholders but {len(images)} images and "
                f"{len(videos)} videos were given; put one image/video part per medium in the messages")
        split = self._split
        img_it, vid_it = iter(images), iter(videos)
        rows = []
        for text, ids in zip(texts, encoded, strict=True):
            cuts = [i for i, x in enumerate(ids) if x == t.image_pad or x == t.video_pad]
            mine = [(ids[c], next(img_it) if ids[c] == t.image_pad else next(vid_it)) for c in cuts]
            if any(ids[c] == t.video_pad and c > 0 and ids[c - 1] not in split for c in cuts):
                # a timestamp would touch ordinary text: only whole-string tokenisation is exact
                rows.append(self._encode_expanded(text, mine))
                continue
            row, last = [], 0
            for c, (kind, item) in zip(cuts, mine, strict=True):
                row += ids[last:c]  # list += tuple slice: extends
                row += [t.image_pad] * item if kind == t.image_pad else self.video_ids(*item)
                last = c + 1
            row += ids[last:]
            rows.append(row)
        return rows

    def _encode_expanded(self, text: str, media: list) -> list[int]:
        pieces = re.split(r"(<\|image_pad\|>|<\|video_pad\|>)", text)
        it = iter(media)
        out = []
        for piece in pieces:
            if piece == "<|image_pad|>":
                out.append("<|image_pad|>" * next(it)[1])
            elif piece == "<|video_pad|>":
                out.append(self._video_text(*next(it)[1]))
            else:
                out.append(piece)
        return self.tokenizer("".join(out), add_special_tokens=True)["input_ids"]


def pad_batch(rows: list[list[int]], pad_id: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask int64 `[B, L]`, padded on `side` ('left' or 'right')."""
    length = max((len(r) for r in rows), default=0)
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, r in enumerate(rows):
        sl = slice(length - len(r), length) if side == "left" else slice(0, len(r))
        ids[i, sl] = r
        mask[i, sl] = 1
    return ids, mask
