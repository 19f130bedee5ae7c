"""Caption-quality flags: cheap per-answer checks made as rows are written (no model, no extra pass).

`QualityJudge.flags(answers, finish_reasons, prompts, media)` gives each ok answer a list of flags
(an error row gets None; a clean answer []):
- `empty`: nothing but white space.
- `truncated`: the generation stopped at `max_tokens` (finish_reason `length`).
- `repetition`: the answer loops: word 3-grams (character 6-grams for text without spaces, e.g.
  Chinese) that occur at least `REPEAT_MIN` times each make up at least `REPEAT_SHARE` of its
  n-grams. The usual failure of a small or greedy model: "a red car, a red car, a red car, ...".
- `too_short` / `too_long`: against the run's own answers to the same prompt (a caption and "how many
  people?" have different lengths): below `SHORT_RATIO` x or above `LONG_RATIO` x the median length of
  that prompt's answers seen so far, once `MIN_SEEN` of them were seen. The lengths are kept in a
  log-spaced histogram per prompt (64 buckets), for at most `MAX_PROMPTS` prompts: bounded memory.
- `duplicate`: the same normalised answer (case, white space and punctuation folded) as an answer to
  the same prompt about another media, for answers of at least `DUPLICATE_MIN_CHARS` characters (short
  answers such as "2" or "yes" repeat by nature). Seen answers are kept as 8-byte hashes in a bounded
  least-recently-seen table (`MAX_HASHES`), so a duplicate further back than that is not flagged.

The judge is a write actor's state: each actor judges the rows it writes against what it has seen, so
the relative checks (length, duplicate) start after a warm-up and see one actor's share of the run;
`vlbatch inspect` counts the flags over the whole run from the rows.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections import Counter, OrderedDict

import numpy as np

FLAGS = ("empty", "truncated", "repetition", "too_short", "too_long", "duplicate")
REPEAT_MIN, REPEAT_SHARE = 4, 0.3
SHORT_RATIO, LONG_RATIO, MIN_SEEN = 0.2, 5.0, 32
MAX_PROMPTS, MAX_HASHES, DUPLICATE_MIN_CHARS = 256, 1 << 17, 24
_BUCKETS = 64  # log2-spaced length buckets, 4 per octave: 1 .. 2**16 characters
_WORD = re.compile(r"\w+", re.UNICODE)
_FOLD = re.compile(r"[\W_]+", re.UNICODE)


def repetition(text: str) -> bool:
    """Whether `text` loops (module docstring); word 3-grams, or character 6-grams when
    the text has fewer than 8 words (scripts written without spaces)."""
    words = _WORD.findall(text.lower())
    grams = list(zip(words, words[1:], words[2:], strict=False)) if len(words) >= 8 else \
        [text[i:i + 6] for i in range(max(0, len(text) - 5))]
    if len(grams) < REPEAT_MIN:
        return False
    looped = sum(n for n in Counter(grams).values() if n >= REPEAT_MIN)
    return looped / len(grams) >= REPEAT_SHARE


def normalise(text: str) -> str:
    """Case, white space and punctuation folded: 'A red car.' == 'a  red car'."""
    return _FOLD.sub(" ", text.lower()).strip()


def _bucket(n: int) -> int:
    return min(_BUCKETS - 1, int(4 * math.log2(max(1, n))))


class _Lengths:
    """One prompt's answer lengths: a log-spaced histogram [64] (median within a quarter octave)."""

    def __init__(self):
        self.hist = np.zeros(_BUCKETS, np.int64)

    def add(self, n: int) -> None:
        self.hist[_bucket(n)] += 1

    def median(self) -> float | None:
        total = int(self.hist.sum())
        if total < MIN_SEEN:
            return None
        b = int(np.searchsorted(np.cumsum(self.hist), (total + 1) / 2))
        return 2 ** ((b + 0.5) / 4)  # the bucket's centre


class QualityJudge:
    """A write actor's flagging state (module docstring); bounded whatever the run's size."""

    def __init__(self):
        self.lengths: OrderedDict[str, _Lengths] = OrderedDict()
        self.seen: OrderedDict[bytes, str] = OrderedDict()  # hash(prompt, answer) -> the media that gave it

    def flags(self, answers: list, finish_reasons: list, prompts: list, media: list) -> list[list[str] | None]:
        """Per row: None where `answers[i]` is None (an error row), else its flags (possibly [])."""
        return [None if a is None else self._one(a, f, p, m)
                for a, f, p, m in zip(answers, finish_reasons, prompts, media, strict=True)]

    def _one(self, answer: str, finish: str | None, prompt: str, media: str | None) -> list[str]:
        text = answer.strip()
        out = []
        if not text:
            out.append("empty")
        if finish == "length":
            out.append("truncated")
        if text and repetition(text):
            out.append("repetition")
        out += self._length(prompt, len(text))
        if len(text) >= DUPLICATE_MIN_CHARS and self._duplicate(prompt, text, media):
            out.append("duplicate")
        return out

    def _length(self, prompt: str, n: int) -> list[str]:
        lengths = self.lengths.get(prompt)
        if lengths is None:
            lengths = self.lengths[prompt] = _Lengths()
            if len(self.lengths) > MAX_PROMPTS:
                self.lengths.popitem(last=False)
        self.lengths.move_to_end(prompt)
        median = lengths.median()
        lengths.add(n)
        if median is None or n == 0:
            return []
        return ["too_short"] if n < SHORT_RATIO * median else ["too_long"] if n > LONG_RATIO * median else []

    def _duplicate(self, prompt: str, text: str, media: str | None) -> bool:
        key = hashlib.blake2b(f"{prompt}\0{normalise(text)}".encode(), digest_size=8).digest()
        first = self.seen.get(key)
        if first is None:
            self.seen[key] = media or ""
            if len(self.seen) > MAX_HASHES:
                self.seen.popitem(last=False)
            return False
        self.seen.move_to_end(key)
        return first != (media or "")
