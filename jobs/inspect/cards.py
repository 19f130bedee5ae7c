"""`vlbatch inspect`'s sample as cards: one card per media, its prompts on it (issue 52).

`cards(rows)` groups the sampled output rows (`run.read_run`: every matching row of each sampled
media) by media (`media_uri`; a row without one is a card of its own), the caption first, then the other
prompts in prompt order (`request_index`; a video's clips in clip order, each clip's prompts together).
A structured answer's `parsed` value (JSON text, untrusted: a run folder is read, not trusted) becomes
`parsed_items`: `[(key, value text)]`, a JSON object flattened to dotted keys (`box.x`), a list of scalars
joined with ", ", a scalar one item keyed by the prompt's name; text that is not JSON is shown as it is.
Both renderers use these (`text`: `key: value` lines; `html`: a small table per value,
every string escaped there).
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

CAPTION = "caption"  # the caption prompt's `prompt_name` (pipeline/stages/requests.py)
MAX_ITEMS = 40  # parsed items shown per answer (the rest counted in one last item)
MAX_VALUE = 200  # characters of one shown value


@dataclass(frozen=True)
class Answer:
    """One prompt's row on a card. `label`: the prompt's name (a manifest's own question has none: 'prompt'),
    with its clip where the row is a clip's; `items`: the parsed value's (key, value) pairs, None for free text."""

    label: str
    row: dict
    items: tuple[tuple[str, str], ...] | None

    @property
    def ok(self) -> bool:
        return self.row.get("status") == "ok"


@dataclass(frozen=True)
class Card:
    media_uri: str | None
    media_type: str | None
    answers: tuple[Answer, ...]

    def status_text(self) -> str:
        """'ok', 'error', or the counts when mixed ('1 ok, 1 error')."""
        n = Counter(a.row.get("status") or "?" for a in self.answers)
        if len(n) == 1:
            return next(iter(n))
        return ", ".join(f"{c} {s}" for s, c in sorted(n.items(), key=lambda x: (x[0] != "ok", x[0])))

    @property
    def ok(self) -> bool:
        return all(a.ok for a in self.answers)


def card_key(row: dict) -> str:
    """The card a row belongs to: its media, or the row alone when it names none (an InputError row)."""
    uri = row.get("media_uri")
    return f"m\x1f{uri}" if uri is not None else f"r\x1f{row.get('id')}"


def media_key(key: str, seed: int) -> float:
    """A uniform [0, 1) number per (card key, seed): every row of one media draws the same, so a sample of
    media keeps all of a media's rows (`run.read_run`)."""
    h = hashlib.blake2b(f"{seed}\x1f{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0 ** 64


def cards(rows: list[dict]) -> list[Card]:
    """The rows grouped into cards, in the order each media first appears in `rows` (module docstring)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(card_key(r), []).append(r)
    out = []
    for members in groups.values():
        members = sorted(members, key=_order)
        first = members[0]
        out.append(Card(first.get("media_uri"), first.get("media_type"), tuple(_answer(r) for r in members)))
    return out


def _order(r: dict) -> tuple:
    clip = r.get("clip_index")
    return (clip is not None, clip or 0, r.get("prompt_name") != CAPTION, r.get("request_index") or 0,
            r.get("id") or "")


def _answer(r: dict) -> Answer:
    label = r.get("prompt_name") or "prompt"
    if r.get("clip_index") is not None:
        span = ""
        if r.get("clip_start_s") is not None and r.get("clip_end_s") is not None:
            span = f" ({r['clip_start_s']:.1f}-{r['clip_end_s']:.1f} s)"
        label = f"clip {r['clip_index']}{span} {label}"
    items = parsed_items(r.get("parsed"), r.get("prompt_name") or "value") if r.get("status") == "ok" else None
    return Answer(label, r, items)


def parsed_items(parsed: str | None, name: str) -> tuple[tuple[str, str], ...] | None:
    """A parsed value (JSON text) as [(key, value)] (module docstring); None when there is none."""
    if parsed is None:
        return None
    try:
        value = json.loads(parsed)
    except (ValueError, RecursionError):
        return ((name, _short(str(parsed))),)
    if isinstance(value, dict):
        items = list(_flatten(value, ""))
        if not items:
            items = [(name, "{}")]
    else:
        items = [(name, _text(value))]
    if len(items) > MAX_ITEMS:
        items = items[:MAX_ITEMS - 1] + [("…", f"{len(items) - MAX_ITEMS + 1} more")]
    return tuple((_short(k), _short(v)) for k, v in items)


def _flatten(obj: dict, prefix: str):
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _flatten(v, f"{key}.")
        elif isinstance(v, list) and any(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                if isinstance(x, dict) and x:
                    yield from _flatten(x, f"{key}[{i}].")
                else:
                    yield f"{key}[{i}]", _text(x)
        else:
            yield key, _text(v)


def _text(v) -> str:
    """A JSON value as shown: strings as they are, lists joined (an empty one `[]`, never a blank cell), null /
    booleans / numbers as JSON writes them."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return ", ".join(_text(x) for x in v) if v else "[]"
    return json.dumps(v, ensure_ascii=False)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_VALUE else text[:MAX_VALUE - 1] + "…"
