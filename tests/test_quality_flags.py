"""Caption-quality flags (issue 53): crafted answers get exactly their flags; the write stage fills the
`quality_flags` column and its stats; the summary and `vlbatch inspect` (terminal and HTML) count them;
a part written before the column existed still reads."""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from vlbatch.operators import quality
from vlbatch.operators.quality import QualityJudge, repetition
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OutputRow, rows_to_table, table_to_rows
from vlbatch.pipeline.stages.rows import Generated, to_table
from vlbatch.pipeline.stages.write_stage import write_batch

CAPTION = "Describe the picture."
LOOP = "a red car on a road, a red car on a road, a red car on a road, a red car on a road, a red car on a road"


def test_crafted_answers_get_their_flags():
    j = QualityJudge()
    got = j.flags([LOOP, "   ", "A tall building beside a river at dusk.", None],
                  ["stop", "stop", "length", None], [CAPTION] * 4, ["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    assert got == [["repetition"], ["empty"], ["truncated"], None]


def test_repetition_needs_one_ngram_to_fill_the_answer():
    assert repetition(LOOP)
    assert not repetition("A cat sleeps on a sofa next to a window; the room is bright and a plant stands near it.")
    assert repetition("红色的汽车红色的汽车红色的汽车红色的汽车红色的汽车")  # no spaces: character 6-grams
    assert not repetition("一只猫在窗边的沙发上睡觉，房间很明亮。")


def test_the_same_answer_for_two_media_is_a_duplicate_but_not_for_one_media_or_a_short_answer():
    j = QualityJudge()
    text = "A green triangle and a blue circle on a white background."
    assert j.flags([text], ["stop"], [CAPTION], ["a.png"]) == [[]]
    assert j.flags([text], ["stop"], [CAPTION], ["a.png"]) == [[]]  # the same media again (a retried batch)
    # case, white space and punctuation folded
    assert j.flags(["a green triangle and a blue circle on a white background"], ["stop"], [CAPTION],
                   ["b.png"]) == [["duplicate"]]
    assert j.flags([text], ["stop"], ["Another prompt?"], ["c.png"]) == [[]]  # another prompt's answers are apart
    assert j.flags(["2", "2"], ["stop", "stop"], ["How many?"] * 2, ["a.png", "b.png"]) == [[], []]


def test_lengths_are_judged_against_the_prompts_own_answers_after_a_warm_up():
    j = QualityJudge()
    normal = [f"A photo of scene number {i} with two shapes on a plain background." for i in range(40)]
    flags = j.flags(normal, ["stop"] * 40, [CAPTION] * 40, [f"m{i}" for i in range(40)])
    assert all(f == [] for f in flags)  # nothing is judged before MIN_SEEN answers
    long = " ".join(f"word{i}" for i in range(120))  # ~800 characters vs a median of ~65
    assert j.flags(["Shapes.", long], ["stop", "stop"], [CAPTION] * 2, ["x", "y"]) == [["too_short"], ["too_long"]]
    # the short answer to another prompt is that prompt's first: nothing to compare with
    assert j.flags(["Yes."], ["stop"], ["Is there text?"], ["x"]) == [[]]


def test_the_judge_stays_bounded(monkeypatch):
    monkeypatch.setattr(quality, "MAX_HASHES", 8)
    monkeypatch.setattr(quality, "MAX_PROMPTS", 4)
    j = QualityJudge()
    for i in range(50):
        j.flags([f"an answer long enough to be remembered, number {i}"], ["stop"], [f"prompt {i % 9}"], [f"m{i}"])
    assert len(j.seen) == 8 and len(j.lengths) == 4


def _batch() -> pa.Table:
    gens = [Generated(f"m{i}.jpg", "image", (f"id{i}",), (0,), (CAPTION,), answers=(answer,), thinking=(None,),
                      statuses=("ok" if answer is not None else "error",), finish_reasons=(finish,),
                      req_error_types=(None if answer is not None else "MediaError",),
                      req_error_messages=(None if answer is not None else "corrupt",),
                      prompt_tokens=(10,), generated_tokens=(5,), cached_tokens=(0,))
            for i, (answer, finish) in enumerate([(LOOP, "stop"), ("", "stop"), ("A cat.", "length"),
                                                  ("Two shapes on a white background, drawn flat.", "stop"),
                                                  ("two shapes on a white background drawn flat", "stop"),
                                                  (None, None)])]
    return to_table(gens, Generated)


def _config(tmp_path):
    from vlbatch.pipeline.config import JobConfig

    return JobConfig.model_validate({"model": {"path": "m"}, "input": {"uri": str(tmp_path / "in.jsonl")},
                                     "output": {"uri": str(tmp_path / "out")}})


def test_the_write_stage_fills_the_column_and_its_stats(tmp_path):
    sink = ParquetSink(str(tmp_path / "out" / "r"))
    stats = write_batch(_batch(), cfg=_config(tmp_path), run_dir=sink.uri, run_id="r", sink=sink)
    want = [["repetition"], ["empty"], ["truncated"], [], ["duplicate"], None]
    assert stats["quality_flags"].to_pylist() == want
    rows = pq.read_table(stats["file"][0].as_py())
    assert rows["quality_flags"].to_pylist() == want and rows.schema.field("quality_flags").type == pa.list_(pa.string())


def test_progress_and_the_summary_count_the_flags(tmp_path):
    from vlbatch.pipeline.telemetry.progress import Progress

    sink = ParquetSink(str(tmp_path / "out" / "r"))
    stats = write_batch(_batch(), cfg=_config(tmp_path), run_dir=sink.uri, run_id="r", sink=sink)
    p = Progress(total=6, stream=io.StringIO())
    p.update(stats)
    assert dict(p.quality) == {"repetition": 1, "empty": 1, "truncated": 1, "duplicate": 1}


def _row(i: int, answer: str | None, flags) -> OutputRow:
    return OutputRow(id=f"id{i}", request_index=0, media_uri=f"m{i}.jpg", media_type="image", prompt=CAPTION,
                     status="ok" if answer is not None else "error", model="m", run_id="r", answer=answer,
                     error_type=None if answer is not None else "MediaError", quality_flags=flags)


def test_inspect_counts_flags_over_the_run_with_examples_and_reads_older_parts(tmp_path):
    from vlbatch.jobs.inspect.html import render
    from vlbatch.jobs.inspect.run import RunRef, read_run
    from vlbatch.jobs.inspect.text import print_report

    run = tmp_path / "r"
    sink = ParquetSink(str(run))
    rows = [_row(0, LOOP, ("repetition",)), _row(1, "", ("empty", "too_short")), _row(2, "A cat.", ()),
            _row(3, None, None)]
    assert table_to_rows(rows_to_table(rows)) == rows  # the column round-trips (tuples in, tuples out)
    sink.commit(rows_to_table(rows))
    old = rows_to_table([_row(4, "An older answer.", None)]).drop_columns(["quality_flags"])
    pq.write_table(old, run / f"part-{0:024x}.parquet")  # a part (the sink's name form) written before the column existed
    rep = read_run(RunRef(str(run)))
    assert rep.rows == 5 and dict(rep.quality) == {"repetition": 1, "empty": 1, "too_short": 1}
    assert rep.quality_rows["repetition"][0]["answer"] == LOOP
    out = io.StringIO()
    print_report(rep, out)
    assert "answer quality flags" in out.getvalue() and "repetition" in out.getvalue()
    page = render(rep, {})
    assert 'id="quality"' in page and "too_short" in page
