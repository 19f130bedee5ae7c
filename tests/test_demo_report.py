"""The demo's structured-question score and scene-cut count (issues 52, 51), at unit level; the real demo's
printout is checked by tests/test_inspect.py::test_demo_ends_with_its_closing_line_and_inspect_reads_its_run."""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlbatch.jobs.demo_report import cuts, grouped, judge, print_report, scene_at, score


def _row(uri, name, *, parsed=None, answer=None, status="ok", clip=None, start=None, end=None):
    return {"media_uri": uri, "status": status, "error_type": None if status == "ok" else "MediaError",
            "answer": answer, "prompt_name": name, "parsed": parsed, "clip_index": clip, "clip_start_s": start,
            "clip_end_s": end}


def test_a_structured_answer_is_judged_against_the_generators_record():
    assert judge('{"count": 2, "shapes": ["square", "circle"]}', ["circle", "square"]) == (True, True)
    assert judge('{"count": 3, "shapes": ["circle", "circle"]}', ["circle", "square"]) == (False, False)
    assert judge('{"count": 1, "shapes": ["circle", "circle"]}', ["circle"]) == (False, True)  # a multiset
    assert judge(None, ["circle"]) == (False, False) and judge("not json", ["circle"]) == (False, False)


def test_clips_of_a_reel_take_the_scene_they_overlap_most_and_cuts_count_within_a_frame():
    reel = {"fps": 8.0, "scenes": [{"start_s": 0.0, "end_s": 2.0, "shapes": ["circle"], "caption": "a"},
                                   {"start_s": 2.0, "end_s": 5.0, "shapes": ["square"], "caption": "b"}]}
    assert scene_at(reel, 1.875, 5.0)["caption"] == "b" and scene_at(reel, 0.0, 2.125)["caption"] == "a"
    assert scene_at(reel, None, None) is None and scene_at({"shapes": []}, None, None) == {"shapes": []}
    got = cuts([0.0, 2.125, 3.5, 5.0], [2.0, 5.0, 7.0], 0.125)
    assert (got.found, got.true, got.hit, got.extra) == (3, 3, 2, 1)
    assert got.text() == "3 cuts found, 3 true: 2/3 within 0.125 s (one frame) of a true cut, 1 extra"


def test_the_printout_scores_media_and_clips_and_counts_error_rows(tmp_path):
    truth = {"/m/a.png": {"caption": "One shape.", "shapes": ["circle"]},
             "/m/reel.mp4": {"fps": 8.0, "scenes": [
                 {"start_s": 0.0, "end_s": 2.0, "shapes": ["circle", "square"], "caption": "A circle moves."},
                 {"start_s": 2.0, "end_s": 4.0, "shapes": ["triangle"], "caption": "A triangle moves."}]}}
    rows = [_row("/m/a.png", "shapes", parsed='{"count":1,"shapes":["circle"]}'),
            _row("/m/a.png", "caption", answer="One shape."),
            _row("/m/reel.mp4", "shapes", parsed='{"count":2,"shapes":["square","circle"]}', clip=0, start=0.0,
                 end=2.0),
            _row("/m/reel.mp4", "caption", answer="A circle moves.", clip=0, start=0.0, end=2.0),
            _row("/m/reel.mp4", "shapes", status="error", clip=1, start=2.0, end=4.0),
            _row("/m/reel.mp4", "caption", answer="A triangle moves.", clip=1, start=2.0, end=4.0),
            _row("/m/bad.png", "shapes", status="error"), _row("/m/bad.png", "caption", status="error")]
    assert score(grouped(rows), truth).text() == "shapes: 2/3 exact, count: 2/3 (1 error rows)"
    table = pa.Table.from_pylist(rows, schema=pa.schema([
        ("media_uri", pa.string()), ("status", pa.string()), ("error_type", pa.string()), ("answer", pa.string()),
        ("prompt_name", pa.string()), ("parsed", pa.string()), ("clip_index", pa.int32()),
        ("clip_start_s", pa.float64()), ("clip_end_s", pa.float64())]))
    (tmp_path / "run").mkdir()
    pq.write_table(table, tmp_path / "run" / "part-0.parquet")
    out = io.StringIO()
    print_report(tmp_path, 10, truth, out)
    text = out.getvalue()
    assert text.startswith("8 rows in 1 Parquet files") and "  bad.png" in text and "error MediaError" in text
    assert "reel.mp4 clip 1 2.00-4.00 s  model: A triangle moves." in text
    assert "truth (scene 2.00-4.00 s): A triangle moves." in text
    assert "shapes: 2/3 exact, count: 2/3 (1 error rows)" in text
    assert "[demo] scene cuts in reel.mp4: 1 cuts found, 1 true: 1/1 within 0.125 s" in text


def test_the_reel_joins_scenes_with_hard_cuts_at_their_recorded_times(tmp_path):
    from vlbatch.devtools.scenes.reel import make_reel
    from vlbatch.pipeline.demo import REEL_SEEDS, demo_truth, write_reel

    reel = make_reel(REEL_SEEDS[:2])
    first = reel.scenes[0]
    assert first.start_s == 0.0 and reel.cuts_s == (first.end_s,) and reel.scenes[1].end_s * 8 == len(reel.frames)
    cut = int(first.end_s * reel.fps)  # frames differ across the cut far more than within a scene
    diff = np.abs(np.diff(reel.frames.astype(np.int16), axis=0)).mean(axis=(1, 2, 3))
    assert int(np.argmax(diff)) == cut - 1 and diff[cut - 1] > 4 * np.delete(diff, cut - 1).max()
    media = tmp_path / "media"
    (path, record), = write_reel(media).items()
    assert path.endswith("reel.mp4") and record["fps"] == 8.0 and len(record["scenes"]) == len(REEL_SEEDS)
    assert all(s["caption"] and s["shapes"] for s in record["scenes"])
    (media / "scenes.json").write_text(json.dumps({path: record}))
    assert demo_truth(tmp_path)[path] == record
