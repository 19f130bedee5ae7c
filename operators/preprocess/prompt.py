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

User text is tokenised as text. A plain string prompt is tokenised as the
reference does (the whole string, control-token strings in it read as control
tokens: the processor's public contract). The pipeline's prompts are `ChatText`s
(`chat_text`: the rendering with its user text located, `user_text.py`): there no
added token can come from the user's characters. Where they hold no added-token
string, the ids are the whole-string ids (the reference's); where they do, the
template's pieces are split at their added tokens and each run of text between
two of them, user text included, goes through the tokenizer's normaliser,
pre-tokeniser and model with no added token matched (`text_ids`): the ids the
reference gives the same text when it holds no such string. Decoding answers is
unchanged (`skip_special_tokens=True`): a control-token string the model writes
as text stays in the answer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from vlbatch.operators.errors import InputError, SetupError
from vlbatch.operators.preprocess.user_text import ChatText, align, masked, plain_ids, text_backend

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
        # added tokens (id -> its string): the tokenizer splits text at each of them
        added = {int(i): str(getattr(t, "content", t)) for i, t in tokenizer.added_tokens_decoder.items()}
        self._split = frozenset(added)
        self._added_ids = {text: i for i, text in added.items()}
        # any added token's string, longest first (leftmost-longest, as the tokenizer matches them)
        alternatives = "|".join(re.escape(t) for t in sorted(self._added_ids, key=len, reverse=True))
        self._control = re.compile(f"({alternatives})") if added else None
        self._backend = text_backend(tokenizer)  # None: user text with a control string is refused
        self._parts: dict[str, tuple[str | int, ...]] = {}  # template piece -> its text runs and added ids
        self._chat_ids: dict[ChatText, tuple[int, ...]] = {}  # user text tokenised as text (`text_ids`)

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

    def chat_text(self, messages: list[dict], **kwargs) -> ChatText:
        """`render(messages, **kwargs)` with its user text located (`ChatText`): every text field of the
        messages' content. `InputError` when the template rewrites the text (beyond trimming it) and
        a text holds an added token's string, which could then not be kept as text."""
        rendered = self.render(messages, **kwargs)
        masks, texts = masked(messages)
        try:
            template = self.render(masks, **kwargs)
        except InputError:  # the template rejects its own sentinels: no split, as for rewritten text
            template = None
        chat = None if template is None else align(rendered, template, texts)
        if chat is not None:
            return chat
        bad = self.control_string(texts)
        if bad is not None:
            raise InputError(f"the text holds {bad!r}, and the chat template rewrites the text it is given, so "
                             "it could not be kept as text (it would read as a control token); remove it")
        return ChatText.whole(rendered)

    def control_string(self, texts) -> str | None:
        """The first added token's string found in `texts` (`<|im_end|>`, `<|image_pad|>`, `<think>`...), or None."""
        if self._control is not None:
            for text in texts:
                if m := self._control.search(text):
                    return m.group(0)
        return None

    def _template_parts(self, piece: str) -> tuple[str | int, ...]:
        """A piece of the template's own text as its text runs (str) and added tokens (id), in order."""
        if self._control is None:
            return (piece,)
        split = self._control.split(piece)  # text, token, text, token, ..., text
        return tuple(self._added_ids[x] if i % 2 else x for i, x in enumerate(split) if x)

    def _piece_parts(self, piece: str) -> tuple[str | int, ...]:
        return cached(self._parts, piece, lambda: self._template_parts(piece))

    def text_ids(self, chat: ChatText, expanded: tuple[str, ...] | None = None) -> list[int]:
        """Token ids of `chat` with its user text tokenised as text (no added token from it; the
        module docstring); `expanded`: its pieces with the placeholders expanded (not cached)."""
        if self._backend is None:
            bad = self.control_string(chat.user)
            if bad is not None:
                raise InputError(f"the text holds {bad!r}, which this checkpoint's tokenizer cannot keep as text "
                                 "(its added tokens strip whitespace, or encoding adds tokens); remove it")
            return self.tokenizer("".join(expanded) if expanded else chat.text, add_special_tokens=True)["input_ids"]
        parts = self._piece_parts if expanded is None else self._template_parts
        out: list[int] = []
        run: list[str] = []  # text since the last added token: template text and user text alike
        for k, piece in enumerate(chat.pieces if expanded is None else expanded):
            for x in parts(piece):
                if isinstance(x, int):
                    out += plain_ids(self._backend, "".join(run))
                    out.append(x)
                    run = []
                else:
                    run.append(x)
            if k < len(chat.user):
                run.append(chat.user[k])
        return out + plain_ids(self._backend, "".join(run))

    def _as_text(self, chat: ChatText, whole: tuple[int, ...]) -> tuple[int, ...]:
        """`whole` (the rendered string's ids) when the user text added no control token to them (the
        reference's ids), else `text_ids`."""
        template = [x for p in chat.pieces for x in self._piece_parts(p) if isinstance(x, int)]
        if self.control_string(chat.user) is None and [x for x in whole if x in self._split] == template:
            return whole
        return cached(self._chat_ids, chat, lambda: tuple(self.text_ids(chat)))

    def _stamp(self, seconds: float) -> list[int]:
        text = f"<{seconds:.1f} seconds>"
        return cached(self._stamp_ids, text, lambda: self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _ids(self, texts: list[str | ChatText]) -> list[tuple[int, ...]]:
        """Token ids of each rendered text (special tokens added; a `ChatText`'s user text as text);
        unseen texts are tokenised in one call."""
        keys = [t.text if isinstance(t, ChatText) else t for t in texts]
        missing = [t for t in dict.fromkeys(keys) if t not in self._text_ids]
        if missing:
            if len(self._text_ids) + len(missing) > CACHE_ENTRIES:
                self._text_ids.clear()
            for t, ids in zip(missing, self.tokenizer(missing, add_special_tokens=True)["input_ids"], strict=True):
                self._text_ids[t] = tuple(ids)
        whole = [self._text_ids[k] for k in keys]
        return [self._as_text(t, ids) if isinstance(t, ChatText) and t.user else ids
                for t, ids in zip(texts, whole, strict=True)]

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

    def encode(self, texts: list[str | ChatText], images: list[int],
               videos: list[tuple[int, tuple[float, ...]]]) -> list[list[int]]:
        """Token ids of each text with placeholders expanded (a `ChatText`'s user text as text).

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

    def _encode_expanded(self, text: str | ChatText, media: list) -> list[int]:
        """Ids of `text` tokenised with its placeholders expanded (the template's, never the user's)."""
        it = iter(media)
        if isinstance(text, ChatText) and text.user and self.control_string(text.user) is not None:
            return self.text_ids(text, tuple(self._expand(p, it) for p in text.pieces))
        whole = text.text if isinstance(text, ChatText) else text
        return self.tokenizer(self._expand(whole, it), add_special_tokens=True)["input_ids"]

    def _expand(self, text: str, media) -> str:
        """`text` with each placeholder replaced by its expansion (`media`: an iterator over (kind, item))."""
        out = []
        for piece in re.split(r"(<\|image_pad\|>|<\|video_pad\|>)", text):
            if piece == "<|image_pad|>":
                out.append("<|image_pad|>" * next(media)[1])
            elif piece == "<|video_pad|>":
                out.append(self._video_text(*next(media)[1]))
            else:
                out.append(piece)
        return "".join(out)


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
