"""Caption and question/answer texts of scenes (the one place their wording lives).

Every answer is one short sentence ending in "."; the model is trained to follow
it with `<|im_end|>`. Each QA carries a `target`: the attribute value its answer
states, which the scorer reads back from generated text (`score.py`).

Tasks: images "caption", "count", "colour", "shape", "position";
videos "video_caption", "motion", "colour_start", "colour_end".
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from vlbatch.devtools.scenes.vocab import NUMBER_WORDS, POSITION_PHRASES


@dataclass(frozen=True)
class QA:
    """One question with its ground-truth answer; `task` names what it asks (see `texts.TASKS`)."""

    task: str
    question: str
    answer: str
    target: str  # the attribute value the answer states, e.g. "red", "2", "top left", "right"


IMAGE_TASKS = ("caption", "count", "colour", "shape", "position")
VIDEO_TASKS = ("video_caption", "motion", "colour_start", "colour_end")
TASKS = IMAGE_TASKS + VIDEO_TASKS

IMAGE_CAPTION_PROMPTS = (
    "Describe the image.", "Describe this image briefly.", "What is in the image?",
    "Describe this image in one sentence.",
)  # fmt: skip
VIDEO_CAPTION_PROMPTS = (
    "Describe the video.", "Describe this video briefly.", "What happens in the video?",
    "Describe what happens in this video in one sentence.",
)  # fmt: skip


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def shape_phrase(shape) -> str:
    """"a large red circle at the top left"."""
    return f"a {shape.size} {shape.colour} {shape.kind} {POSITION_PHRASES[shape.position]}"


def image_caption(shapes) -> str:
    """"Two shapes: a large red circle at the top left and a small blue square in the center."."""
    n = len(shapes)
    parts = [shape_phrase(s) for s in shapes]
    listed = parts[0] if n == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    noun = "shape" if n == 1 else "shapes"
    return f"{_cap(NUMBER_WORDS[n])} {noun}: {listed}."


def image_qas(shapes, caption: str) -> list:
    """Every question this image can answer unambiguously (kinds asked by name only when unique)."""
    qas = [QA("caption", p, caption, str(len(shapes))) for p in IMAGE_CAPTION_PROMPTS]
    n = len(shapes)
    qas.append(QA("count", "How many shapes are there?", f"{_cap(NUMBER_WORDS[n])}.", str(n)))
    kinds = Counter(s.kind for s in shapes)
    for s in shapes:
        if kinds[s.kind] == 1:
            qas.append(QA("colour", f"What colour is the {s.kind}?", f"{_cap(s.colour)}.", s.colour))
        qas.append(QA("shape", f"What shape is {POSITION_PHRASES[s.position]}?", f"A {s.kind}.", s.kind))
        same = sum(1 for t in shapes if (t.colour, t.kind) == (s.colour, s.kind))
        if same == 1:
            qas.append(
                QA("position", f"Where is the {s.colour} {s.kind}?", f"{_cap(POSITION_PHRASES[s.position])}.",
                   s.position)
            )
    return qas


def video_shape_sentence(shape) -> str:
    """"A red circle moves right quickly." / "A blue square stays still." / "A square changes from green to blue."."""
    if shape.colour_end != shape.colour_start:
        return f"A {shape.kind} changes from {shape.colour_start} to {shape.colour_end}."
    if shape.motion == "still":
        return f"A {shape.colour_start} {shape.kind} stays still."
    return f"A {shape.colour_start} {shape.kind} moves {shape.motion} {shape.speed}."


def video_caption(shapes) -> str:
    """The sentences of the shapes, the active shape (moving or changing) first."""
    return " ".join(video_shape_sentence(s) for s in shapes)


def video_qas(shapes, caption: str) -> list:
    """Caption, motion direction and start / end colour questions (kinds are unique in videos)."""
    qas = [QA("video_caption", p, caption, shapes[0].motion) for p in VIDEO_CAPTION_PROMPTS]
    for s in shapes:
        answer = "It stays still." if s.motion == "still" else f"{_cap(s.motion)}."
        qas.append(QA("motion", f"Which way does the {s.kind} move?", answer, s.motion))
        qas.append(QA("colour_start", f"What colour is the {s.kind} at the start?", f"{_cap(s.colour_start)}.",
                      s.colour_start))
        qas.append(QA("colour_end", f"What colour is the {s.kind} at the end?", f"{_cap(s.colour_end)}.",
                      s.colour_end))
    return qas
