"""Issue 31, items 1 and 10 (sink side): a run_id that names output.uri or its parent is refused, the
sink deletes only what it wrote, and a sealed run holds each id once (a write call run twice)."""
from __future__ import annotations

import os

import pyarrow as pa
import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.rolling import PartRoller, RollPolicy
from vlbatch.operators.sink.schema import OutputRow, rows_to_table


def _rows(ids, status="ok", error_type=None, answer="a"):
    return rows_to_table([OutputRow(id=i, request_index=0, media_uri=f"/m/{i}.jpg", media_type="image", prompt="p",
                                    status=status, model="m", run_id="r", error_type=error_type,
                                    answer=answer if status == "ok" else None) for i in ids])


def _ids(n, start=0):
    return [f"{i:032x}" for i in range(start, start + n)]


@pytest.mark.parametrize("run_id", [".", ".."])
def test_run_id_naming_the_output_or_its_parent_is_refused(tmp_path, run_id):
    from vlbatch.pipeline.config import validate_config

    with pytest.raises(ConfigError, match=r"output\.run_id"):
        validate_config({"model": {"path": str(tmp_path)}, "input": {"uri": str(tmp_path / "m.jsonl"),
                                                                      "format": "jsonl"},
                         "output": {"uri": str(tmp_path / "out"), "run_id": run_id}})
    ok = validate_config({"model": {"path": str(tmp_path)}, "input": {"uri": str(tmp_path / "m.jsonl"),
                                                                       "format": "jsonl"},
                          "output": {"uri": str(tmp_path / "out"), "run_id": "a..b"}})
    assert ok.output.run_id == "a..b"  # dots inside a name are a name


def test_cleanup_deletes_only_what_the_sink_wrote(tmp_path):
    """Foreign files under `_tmp/` (and `_tmp/staged/`) survive `prepare` and `seal`; the sink's own
    staged batches and marked temp files are gone."""
    run = tmp_path / "run"
    sink = ParquetSink(str(run))
    sink.prepare()
    foreign = [run / "_tmp" / "keep.txt", run / "_tmp" / "part-abc.parquet.123", run / "_tmp" / "staged" / "notes.parquet",
               run / "_tmp" / "staged" / "w" / "mine.parquet", run / "_tmp" / "other" / "x.bin"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"not yours")
    r = PartRoller(sink, RollPolicy(target_bytes=None, target_rows=100, interval_s=1e9), "w")
    r.add(_rows(_ids(3)))  # staged, held
    debris = run / "_tmp" / "staged" / "w" / ("part-" + "0" * 24 + ".parquet." + "1" * 32 + ".vlbatch-tmp")
    debris.write_bytes(b"half")
    sink.prepare()  # a rerun: the staged batch and the temp debris go, the foreign files stay
    assert all(f.read_bytes() == b"not yours" for f in foreign)
    assert not debris.exists() and not list((run / "_tmp" / "staged" / "w").glob("part-*.parquet"))
    r2 = PartRoller(sink, RollPolicy(target_bytes=None, target_rows=100, interval_s=1e9), "w2")
    r2.add(_rows(_ids(2, 10)))
    assert sink.seal() and sink.read().num_rows == 2  # the foreign *.parquet files were never published
    assert all(f.read_bytes() == b"not yours" for f in foreign)
    assert not (run / "_tmp" / "staged" / "w2").exists()  # our emptied folder is removed


def _generated(ids, answer="x"):
    from vlbatch.pipeline.stages.rows import Generated, to_table

    n = len(ids)
    g = Generated(f"/m/{ids[0]}.png", "image", tuple(ids), tuple(range(n)), tuple(f"p{i}" for i in range(n)),
                  answers=(answer,) * n, thinking=(None,) * n, statuses=("ok",) * n, req_error_types=(None,) * n,
                  req_error_messages=(None,) * n, finish_reasons=("stop",) * n, prompt_tokens=(1,) * n,
                  generated_tokens=(1,) * n, cached_tokens=(0,) * n, visual_tokens=4)
    return to_table([g], Generated)


def test_a_write_stage_run_twice_on_one_block_leaves_one_row_per_id(tmp_path):
    """Ray re-executing a write call that had already returned (lineage reconstruction): the first
    actor published the block inside a larger part, a second actor gets the same block again and
    publishes it too. After the run's `seal` every id is there once."""
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.stages.write_stage import WriteStage

    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"},
                           "output": {"uri": str(tmp_path), "part_rows": 4, "commit_interval_s": 86400.0}})
    run = str(tmp_path / "run")
    ParquetSink(run).prepare()
    block, other, third = _generated(_ids(2)), _generated(_ids(2, 2)), _generated(_ids(1, 8))
    first = WriteStage(cfg, run, "r")
    first(block)
    first(other)
    first(third)  # publishes block + other as one part (4 rows), holds `third`
    again = WriteStage(cfg, run, "r")
    again(block)  # the re-executed call: the same block, another actor
    again(_generated(_ids(4, 20)))  # ... which reaches its own target and publishes block again
    again(_generated(_ids(1, 30)))
    sink = ParquetSink(run)
    assert sink.index().duplicate_ids == 2  # two copies of the block's ids, as main left them
    sink.seal(4)  # the runner's end of the run
    ids = sink.read().column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 2 + 2 + 1 + 4 + 1
    assert sink.index().duplicate_ids == 0


def test_a_transient_copy_never_wins_over_a_done_row(tmp_path):
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    sink.commit(_rows(_ids(3)))
    sink.commit(_rows(_ids(2, 1), status="error", error_type="StorageError"))  # copies of ids 1, 2, transient
    PartRoller(sink, RollPolicy(target_bytes=None, target_rows=100, interval_s=1e9), "w").add(
        _rows(_ids(1, 3), status="error", error_type="EngineError"))  # staged; id 3 only as a transient row
    sink.seal()
    out = sink.read().to_pylist()
    assert [(r["id"], r["status"]) for r in out] == [(i, "ok") for i in _ids(3)] + [(_ids(1, 3)[0], "error")]
    assert sink.index().duplicate_ids == 0


def test_dedupe_keeps_rows_whole_and_is_deterministic(tmp_path):
    from vlbatch.operators.sink.dedupe import duplicate_rows

    t1 = pa.table({"id": _ids(3), "status": ["ok", "error", "ok"], "error_type": [None, "StorageError", None]})
    t2 = pa.table({"id": _ids(3), "status": ["ok", "ok", "error"], "error_type": [None, None, "MediaError"]})
    drop = duplicate_rows([("p1", t1), ("p2", t2)])
    # id0: both done, the first part keeps it; id1: the done row (p2) beats the transient one (p1);
    # id2: ok and a permanent error are both done, the first part keeps it
    assert {k: v.tolist() for k, v in drop.items()} == {"p1": [False, True, False], "p2": [True, False, True]}
    assert duplicate_rows([("p1", t1)]) == {}
    same = pa.table({"id": [_ids(1)[0]] * 3, "status": ["ok"] * 3, "error_type": pa.array([None] * 3, pa.string())})
    assert duplicate_rows([("p", same)])["p"].tolist() == [False, True, True]  # within one part too
    assert os.path.basename(str(tmp_path))  # (tmp_path unused otherwise)
