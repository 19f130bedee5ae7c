"""User text in a rendered chat prompt, found so it can be tokenised as text.

The text fields of chat messages (a string content, `{"type": "text", "text": ...}` parts) come
from manifests and job configs: untrusted. Tokenising the rendered prompt as one string would
read `<|im_end|>`, `<|im_start|>`, `<|image_pad|>`, `<think>` written in them as the chat
template's control tokens (a forged turn, a placeholder without its media). `ChatText` records
which characters of the rendered prompt are the user's, so `PromptEncoder` can tokenise them as
text while the template's own text keeps its control tokens.

How the user's characters are found (`chat_text`): the template is rendered twice, once with
the real messages and once with each text field replaced by a sentinel (`\\ue000<k>\\ue001`,
private-use characters no template writes); the sentinel rendering splits into the template's
own pieces, and the real rendering must be those pieces with each field in between as given or
whitespace-trimmed (Qwen's templates `| trim` a message's content). A template that rewrites the
text otherwise (upper-cases, escapes) gives no such split: `chat_text` returns None.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def sentinel(k: int) -> str:
    return f"\ue000{k}\ue001"


@dataclass(frozen=True)
class ChatText:
    """A rendered chat prompt and where its user text lies.

    text: the rendered prompt (what `apply_chat_template` returns, the reference's input);
    it equals `pieces[0] + user[0] + pieces[1] + ... + user[n-1] + pieces[n]`: `pieces` [n + 1]
    the template's own text, `user` [n] the messages' text as the template placed it. A
    prompt whose template rewrites the text has `pieces == (text,)`, `user == ()` (see
    `PromptEncoder.chat_text`: allowed only when no user text holds a control string)."""

    text: str
    pieces: tuple[str, ...]
    user: tuple[str, ...]

    @classmethod
    def whole(cls, text: str) -> ChatText:
        """A prompt with no user text found in it (tokenised as one string)."""
        return cls(text, (text,), ())


def masked(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """(the messages with every text field replaced by `sentinel(k)`, the fields' texts [k])."""
    texts: list[str] = []

    def mask(text) -> str:
        texts.append(text)
        return sentinel(len(texts) - 1)

    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            m = {**m, "content": mask(content)}
        elif isinstance(content, (list, tuple)):
            m = {**m, "content": [{**p, "text": mask(p["text"])}
                                  if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                                  for p in content]}
        out.append(m)
    return out, texts


def align(rendered: str, template: str, texts: list[str]) -> ChatText | None:
    """`rendered` split as `template` (the sentinel rendering) places `texts`, or None when the
    template changed a text beyond trimming whitespace (or dropped, reordered or invented one)."""
    parts = _SENTINEL.split(template)  # piece, k, piece, k, ..., piece
    pieces, order = parts[0::2], [int(k) for k in parts[1::2]]
    if any(k >= len(texts) for k in order):
        return None
    placed = _place(rendered, pieces, [texts[k] for k in order], 0, 0)
    return None if placed is None else ChatText(rendered, tuple(pieces), placed)


def _place(rendered: str, pieces: list[str], texts: list[str], k: int, pos: int) -> tuple[str, ...] | None:
    """The forms of texts[k:] (each as given or trimmed) that make rendered[pos:] the interleaving
    of pieces[k:] and them; None when none does (a few fields: at most 4^n tries)."""
    if not rendered.startswith(pieces[k], pos):
        return None
    pos += len(pieces[k])
    if k == len(texts):
        return () if pos == len(rendered) else None
    x = texts[k]
    for form in dict.fromkeys((x, x.strip(), x.rstrip(), x.lstrip())):
        if rendered.startswith(form, pos):
            rest = _place(rendered, pieces, texts, k + 1, pos + len(form))
            if rest is not None:
                return (form, *rest)
    return None


def plain_ids(backend, text: str) -> list[int]:
    """Ids of `text` through a `tokenizers.Tokenizer`'s normaliser, pre-tokeniser and model, with no
    added token matched: what the backend does to the text between two added tokens."""
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    words = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [t.id for word, _ in words if word for t in backend.model.tokenize(word)]


def text_backend(tokenizer):
    """The `tokenizers.Tokenizer` under `tokenizer` (ours: `.backend`; transformers': `.backend_tokenizer`)
    when `plain_ids` reproduces its text handling: its added tokens match their exact strings (no
    lstrip / rstrip / single_word) and encoding adds no token around the text; else None."""
    from tokenizers import Tokenizer as Backend

    found = (getattr(tokenizer, name, None) for name in ("backend_tokenizer", "backend"))
    backend = next((b for b in found if isinstance(b, Backend)), None)
    if backend is None:
        return None
    if any(t.lstrip or t.rstrip or t.single_word for t in backend.get_added_tokens_decoder().values()):
        return None
    return backend if not backend.encode("", add_special_tokens=True).ids else None
