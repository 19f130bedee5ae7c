"""Score generated answers against scene ground truth, attribute by attribute.

Each answer is read back into attribute values with the closed vocabulary
(`vocab.py`) and compared with the truth:
- image questions: one attribute each (count, colour, shape kind, position);
- image captions: the count, then for every true shape, the described shape at the
  same position (matched by position; a shape not described gets all four of
  colour / kind / size / position wrong);
- video questions: motion direction ("still" for shapes that do not move) or the
  start / end colour; video captions: the active shape's direction and colours.

`image_attribute_accuracy` pools every image check; `video_motion_accuracy` pools the
motion checks of video questions and captions.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from vlbatch.devtools.scenes.vocab import COLOURS, DIRECTIONS, KINDS, NUMBER_WORDS, POSITIONS, SIZES, STILL

_WORD = re.compile(r"[a-z]+")
_POSITIONS_LONGEST_FIRST = sorted(POSITIONS, key=len, reverse=True)


@dataclass(frozen=True)
class Check:
    """One attribute of one item: what the truth says and what the answer said (None: not stated)."""

    item_id: str
    task: str
    attribute: str  # "count" | "colour" | "kind" | "size" | "position" | "motion" | "colour_start" | "colour_end"
    expected: str
    got: str | None

    @property
    def correct(self) -> bool:
        return self.got == self.expected


@dataclass(frozen=True)
class Scores:
    """Accuracies (None when no check of that kind ran) and every check behind them."""

    image_attribute_accuracy: float | None
    video_motion_accuracy: float | None
    video_colour_accuracy: float | None
    exact_answers: float  # share of answers equal to the ground-truth text
    checks: tuple[Check, ...]

    def summary(self) -> str:
        def pct(v):
            return "n/a" if v is None else f"{100 * v:.1f}%"

        return (f"image attributes {pct(self.image_attribute_accuracy)}, "
                f"video motion {pct(self.video_motion_accuracy)}, "
                f"video colours {pct(self.video_colour_accuracy)}, exact answers {pct(self.exact_answers)}")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _first(text: str, vocab) -> str | None:
    for w in _words(text):
        if w in vocab:
            return w
    return None


def read_count(text: str) -> str | None:
    for w in _words(text):
        for n, word in NUMBER_WORDS.items():
            if w == word:
                return str(n)
    digits = re.findall(r"\d+", text)
    return digits[0] if digits else None


def read_position(text: str) -> str | None:
    """The position named in `text` ("top left" wins over "top")."""
    low = " ".join(_words(text))
    found = [(low.find(p), -len(p), p) for p in _POSITIONS_LONGEST_FIRST if re.search(rf"\b{p}\b", low)]
    return min(found)[2] if found else None


def read_motion(text: str) -> str | None:
    low = " ".join(_words(text))
    if STILL in low.split() or "not move" in low:
        return STILL
    direction = _first(text, DIRECTIONS)
    if direction is None and "changes" in low.split():  # "A square changes from red to blue." does not move
        return STILL
    return direction


def _caption_shapes(text: str) -> list[dict]:
    """Described shapes of an image caption: dicts of colour / kind / size / position (None when absent)."""
    body = text.split(":", 1)[-1]
    parts = [p for p in re.split(r",| and ", body) if p.strip()]
    return [
        {"colour": _first(p, COLOURS), "kind": _first(p, KINDS), "size": _first(p, SIZES), "position": read_position(p)}
        for p in parts
    ]


def _image_caption_checks(item, answer: str) -> list[Check]:
    shapes = item.scene.shapes
    checks = [Check(item.id, "caption", "count", str(len(shapes)), read_count(answer.split(":", 1)[0]))]
    described = {d["position"]: d for d in _caption_shapes(answer) if d["position"]}
    for s in shapes:
        d = described.get(s.position, {})
        for attr in ("colour", "kind", "size", "position"):
            checks.append(Check(item.id, "caption", attr, getattr(s, attr), d.get(attr)))
    return checks


def _video_caption_checks(item, answer: str) -> list[Check]:
    active = item.scene.shapes[0]
    sentence = next((s for s in re.split(r"(?<=\.)\s*", answer) if active.kind in _words(s)), "")
    colours = [w for w in _words(sentence) if w in COLOURS]
    return [
        Check(item.id, "video_caption", "motion", active.motion, read_motion(sentence) if sentence else None),
        Check(item.id, "video_caption", "colour_start", active.colour_start, colours[0] if colours else None),
        Check(item.id, "video_caption", "colour_end", active.colour_end, colours[-1] if colours else None),
    ]


def item_checks(item, answer: str) -> list[Check]:
    """The attribute checks of one item's answer."""
    task, target = item.qa.task, item.qa.target
    if task == "caption":
        return _image_caption_checks(item, answer)
    if task == "video_caption":
        return _video_caption_checks(item, answer)
    readers = {
        "count": ("count", read_count),
        "colour": ("colour", lambda t: _first(t, COLOURS)),
        "shape": ("kind", lambda t: _first(t, KINDS)),
        "position": ("position", read_position),
        "motion": ("motion", read_motion),
        "colour_start": ("colour_start", lambda t: _first(t, COLOURS)),
        "colour_end": ("colour_end", lambda t: _first(t, COLOURS)),
    }
    attribute, reader = readers[task]
    return [Check(item.id, task, attribute, target, reader(answer))]


def score_answers(items, answers) -> Scores:
    """Score `answers[i]` (generated text, thinking already removed) for `items[i]` (`SceneItem`s)."""
    if len(items) != len(answers):
        raise ValueError(f"{len(items)} items but {len(answers)} answers")
    checks = [c for it, a in zip(items, answers, strict=True) for c in item_checks(it, a)]
    media = {it.id: it.media_type for it in items}

    def acc(selected):
        return sum(c.correct for c in selected) / len(selected) if selected else None

    image = [c for c in checks if media[c.item_id] == "image"]
    motion = [c for c in checks if media[c.item_id] == "video" and c.attribute == "motion"]
    colour = [c for c in checks if media[c.item_id] == "video" and c.attribute.startswith("colour")]
    exact = sum(a.strip() == it.qa.answer for it, a in zip(items, answers, strict=True)) / max(len(items), 1)
    return Scores(acc(image), acc(motion), acc(colour), exact, tuple(checks))


def _alt(words) -> str:
    return "(?:" + "|".join(re.escape(w) for w in words) + ")"


def _grammar() -> dict[str, re.Pattern]:
    """Per task, the regular language of its ground-truth answers (case-insensitive)."""
    from vlbatch.devtools.scenes.vocab import POSITION_PHRASES, SPEEDS

    colour, kind, size = _alt(COLOURS), _alt(KINDS), _alt(SIZES)
    place = _alt(POSITION_PHRASES.values())
    shape = rf"an? {size} {colour} {kind} {place}"
    number = _alt(NUMBER_WORDS.values())
    active = (rf"(?:a {colour} {kind} moves {_alt(DIRECTIONS)} {_alt(SPEEDS)}"
              rf"|a {kind} changes from {colour} to {colour}"
              rf"|a {colour} {kind} stays still)\.")
    flags = re.IGNORECASE
    return {
        "caption": re.compile(rf"{number} shapes?: {shape}(?:, {shape})*(?: and {shape})?\.", flags),
        "count": re.compile(rf"{number}\.", flags),
        "colour": re.compile(rf"{colour}\.", flags),
        "shape": re.compile(rf"an? {kind}\.", flags),
        "position": re.compile(rf"{place}\.", flags),
        "video_caption": re.compile(rf"{active}(?: {active})?", flags),
        "motion": re.compile(rf"(?:{_alt(DIRECTIONS)}|it stays still)\.", flags),
        "colour_start": re.compile(rf"{colour}\.", flags),
        "colour_end": re.compile(rf"{colour}\.", flags),
    }


def is_well_formed(task: str, answer: str) -> bool:
    """Whether `answer` is a sentence of the task's answer language (right form, any attribute values)."""
    return _grammar()[task].fullmatch(answer.strip()) is not None
