"""The scorer reads attributes back from answers and counts exactly the wrong ones."""
from __future__ import annotations

from dataclasses import replace

import pytest

from vlbatch.devtools.scenes.heldout import heldout_items
from vlbatch.devtools.scenes.score import read_motion, read_position, score_answers


@pytest.fixture(scope="module")
def items():
    return heldout_items(25, 20)


def test_true_answers_score_full_marks(items):
    scores = score_answers(items, [it.qa.answer for it in items])
    assert scores.image_attribute_accuracy == 1.0
    assert scores.video_motion_accuracy == 1.0
    assert scores.video_colour_accuracy == 1.0
    assert scores.exact_answers == 1.0
    assert {c.attribute for c in scores.checks} >= {"count", "colour", "kind", "size", "position", "motion"}


def test_one_wrong_caption_attribute_costs_one_check(items):
    item = next(it for it in items if it.qa.task == "caption")
    shape = item.scene.shapes[0]
    other = "blue" if shape.colour != "blue" else "red"
    wrong = item.qa.answer.replace(f"{shape.size} {shape.colour} {shape.kind}", f"{shape.size} {other} {shape.kind}", 1)
    scores = score_answers([item], [wrong])
    bad = [c for c in scores.checks if not c.correct]
    assert len(bad) == 1 and bad[0].attribute == "colour" and bad[0].got == other
    assert len(scores.checks) == 1 + 4 * len(item.scene.shapes)


def test_missing_shape_in_caption_loses_all_its_attributes(items):
    item = next(it for it in items if it.qa.task == "caption" and len(it.scene.shapes) >= 2)
    first = item.qa.answer.split(": ", 1)[1].split(",")[0].split(" and ")[0].rstrip(".")
    n = len(item.scene.shapes)
    answer = f"{['One', 'Two', 'Three'][n - 1]} shapes: {first}."
    bad = [c for c in score_answers([item], [answer]).checks if not c.correct]
    assert len(bad) == 4 * (n - 1)


def test_wrong_direction_and_colour_in_video_answers(items):
    motion = next(it for it in items if it.qa.task == "motion" and it.qa.target not in ("still", "up"))
    colour = next(it for it in items if it.qa.task == "colour_end")
    wrong_colour = "Purple." if colour.qa.target != "purple" else "Red."
    scores = score_answers([motion, colour], ["Up.", wrong_colour])
    assert scores.video_motion_accuracy == 0.0 and scores.video_colour_accuracy == 0.0
    assert score_answers([motion], ["It stays still."]).checks[0].got == "still"


def test_readers():
    assert read_position("At the top left.") == "top left"
    assert read_position("At the top.") == "top"
    assert read_position("In the center.") == "center"
    assert read_position("on the bottom right") == "bottom right"
    assert read_position("Nowhere.") is None
    assert read_motion("Right.") == "right" and read_motion("It does not move.") == "still"


def test_length_mismatch_is_an_error(items):
    with pytest.raises(ValueError):
        score_answers(items, [])


def test_video_caption_checks_the_active_shape(items):
    item = next(it for it in items if it.qa.task == "video_caption" and it.scene.shapes[0].motion != "still")
    active = item.scene.shapes[0]
    flipped = {"left": "right", "right": "left", "up": "down", "down": "up"}[active.motion]
    wrong = item.qa.answer.replace(f"moves {active.motion}", f"moves {flipped}")
    checks = score_answers([item], [wrong]).checks
    assert [c.attribute for c in checks if not c.correct] == ["motion"]
    assert replace(item.qa).target == active.motion


def test_answer_grammar_accepts_truth_and_rejects_noise(items):
    from vlbatch.devtools.scenes.score import is_well_formed

    assert all(is_well_formed(it.qa.task, it.qa.answer) for it in items)
    assert not is_well_formed("caption", "Two shapes: a large red blob at the top.")
    assert not is_well_formed("count", "Two shapes")
    assert not is_well_formed("motion", "Sideways.")
    assert not is_well_formed("video_caption", "A red circle moves right quickly")  # no full stop
