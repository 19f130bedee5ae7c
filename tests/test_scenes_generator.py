"""Synthetic scenes: determinism, ground truth that matches the pixels, held-out split, real MP4 files."""
from __future__ import annotations

import numpy as np
import pytest

from vlbatch.devtools.scenes import decode_mp4, encode_mp4, make_image_scene, make_video_scene
from vlbatch.devtools.scenes.heldout import HELDOUT_SEED_BASE, clip_of, heldout_items
from vlbatch.devtools.scenes.vocab import COLOURS, DIRECTION_VECTORS, POSITIONS, STILL

PALETTE = np.array(list(COLOURS.values()), dtype=np.float64)


def nearest_colour(rgb) -> str:
    return list(COLOURS)[int(np.argmin(((PALETTE - np.asarray(rgb, dtype=np.float64)) ** 2).sum(1)))]


def colour_mask(frame: np.ndarray, colour: str, tol: float = 60.0) -> np.ndarray:
    """[H, W] bool: pixels within `tol` (RGB distance) of a palette colour."""
    return np.linalg.norm(frame.astype(np.float64) - np.asarray(COLOURS[colour]), axis=-1) < tol


def test_same_seed_same_scene_and_different_seeds_differ():
    a, b, c = make_image_scene(7), make_image_scene(7), make_image_scene(8)
    assert np.array_equal(a.image, b.image) and a.caption == b.caption and a.qas == b.qas
    assert not (a.image.shape == c.image.shape and np.array_equal(a.image, c.image))
    va, vb = make_video_scene(7), make_video_scene(7)
    assert np.array_equal(va.frames, vb.frames) and va.caption == vb.caption


@pytest.mark.parametrize("seed", range(0, 40, 5))
def test_image_truth_matches_pixels(seed):
    scene = make_image_scene(seed)
    h, w = scene.image.shape[:2]
    assert 1 <= len(scene.shapes) <= 3
    assert len({s.position for s in scene.shapes}) == len(scene.shapes)
    order = [POSITIONS.index(s.position) for s in scene.shapes]
    assert order == sorted(order), "shapes are listed in reading order"
    for s in scene.shapes:
        y, x = int(s.cy * h), int(s.cx * w)
        assert nearest_colour(scene.image[y, x]) == s.colour
        row, col = divmod(POSITIONS.index(s.position), 3)
        assert int(s.cx * 3) == col and int(s.cy * 3) == row
    count = {"One": 1, "Two": 2, "Three": 3}[scene.caption.split()[0]]
    assert count == len(scene.shapes)


def test_image_questions_are_unambiguous():
    for seed in range(30):
        scene = make_image_scene(seed)
        for qa in scene.qas:
            if qa.task == "colour":  # "the circle" must name exactly one shape
                kind = qa.question.split("the ")[1].rstrip("?")
                assert sum(s.kind == kind for s in scene.shapes) == 1
            assert qa.answer.endswith(".")


def _centroid(frame, colour):
    ys, xs = np.nonzero(colour_mask(frame, colour))
    return np.array([xs.mean() / frame.shape[1], ys.mean() / frame.shape[0]])


@pytest.mark.parametrize("seed", range(6))
def test_video_motion_and_colour_truth_survive_mp4(seed):
    """The labelled motion is what the decoded frames of a real H.264 file show."""
    scene = make_video_scene(seed)
    while any(s.colour_start == scene.shapes[0].colour_start for s in scene.shapes[1:]):
        seed += 1000  # a still shape sharing the mover's colour would mix the centroid check: next scene
        scene = make_video_scene(seed)
    frames = decode_mp4(encode_mp4(scene.frames, scene.fps))
    assert frames.shape == scene.frames.shape
    active = scene.shapes[0]
    if active.colour_start != active.colour_end:
        y, x = int(active.cy * frames.shape[1]), int(active.cx * frames.shape[2])
        assert nearest_colour(frames[0][y, x]) == active.colour_start
        assert nearest_colour(frames[-1][y, x]) == active.colour_end
        return
    move = _centroid(frames[-1], active.colour_start) - _centroid(frames[0], active.colour_start)
    if active.motion == STILL:
        assert np.abs(move).max() < 0.02
    else:
        assert move @ np.array(DIRECTION_VECTORS[active.motion]) > 0.25


def test_video_clip_sampling_and_sizes():
    scene = make_video_scene(3)
    clip = clip_of(scene.frames, scene.fps)
    duration = scene.frames.shape[0] / scene.fps
    assert len(clip.indices) == int(duration * 2) and clip.indices[0] == 0
    assert clip.indices[-1] == scene.frames.shape[0] - 1
    assert scene.frames.shape[1] % 16 == 0 and scene.frames.shape[2] % 16 == 0


def test_heldout_set_is_deterministic_and_disjoint_from_training_seeds():
    a, b = heldout_items(10, 8), heldout_items(10, 8)
    assert [i.id for i in a] == [i.id for i in b]
    assert [i.qa for i in a] == [i.qa for i in b]
    assert all(i.scene.seed >= HELDOUT_SEED_BASE for i in a)
    assert {i.media_type for i in a} == {"image", "video"}
    tasks = {i.qa.task for i in a}
    assert {"caption", "count", "position", "video_caption", "motion"} <= tasks
    assert len({i.id for i in a}) == len(a)


def test_items_write_real_media_files(tmp_path):
    from PIL import Image

    items = heldout_items(2, 2)
    paths = [it.write_media(tmp_path) for it in items]
    assert [p.suffix for p in paths] == [".png", ".png", ".mp4", ".mp4"]
    assert np.array_equal(np.asarray(Image.open(paths[0]).convert("RGB")), items[0].image)
    frames = decode_mp4(paths[2].read_bytes())
    assert frames.shape == items[2].scene.frames.shape
