"""`vlbatch export` and hostile run folders (issue 60, item 9): the rules of `jobs/export/command.py`'s docstring, each
through the CLI in both layouts, on the run folder `test_export.make_run` writes with the real sink. Which
files are parts (foreign ones are ignored), a part without `id` / `status` (one line, exit 1, nothing
written; so is a column every part has, or one whose values do not cast to the run's type), ids unique in
every export (a copied part counts once; a done row wins over a transient copy), a
`parsed` value that is not JSON (one line, exit 1)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_export import make_run

from vlbatch.jobs.cli import main

LAYOUTS = ["rows", "media"]
HEX_PART = "part-" + "f" * 24 + ".parquet"  # a name the sink could have made, last in name order


@pytest.fixture
def run(tmp_path) -> Path:
    return Path(make_run(str(tmp_path / "out")))


def _export(capsys, run: Path, dest: Path, layout: str) -> tuple[int, str, str]:
    code = main(["export", str(run), "--layout", layout, "-o", str(dest)])
    got = capsys.readouterr()
    return code, got.out, got.err


def _clean(capsys, run: Path, tmp_path: Path, layout: str) -> pa.Table:
    """The export of the run as `make_run` left it (the reference)."""
    dest = tmp_path / f"clean-{layout}.parquet"
    assert _export(capsys, run, dest, layout)[0] == 0
    return pq.read_table(dest)


def _parts(run: Path) -> list[Path]:
    return sorted(run.glob("part-*.parquet"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_foreign_files_in_the_run_folder_are_not_read(run, tmp_path, capsys, layout):
    want = _clean(capsys, run, tmp_path, layout)
    pq.write_table(pa.table({"x": [1, 2]}), run / "part-foreign.parquet")  # not a name the sink makes
    pq.write_table(pa.table({"id": ["a", "b"], "status": ["ok", "ok"]}), run / "notes.parquet")
    (run / "part-notes.txt").write_text("not Parquet")
    dest = tmp_path / "x.parquet"
    code, out, err = _export(capsys, run, dest, layout)
    assert code == 0, err
    assert out.startswith("exported 13 rows") and err == ""
    assert pq.read_table(dest).equals(want)


def _damaged(part: Path, how: str) -> None:
    t = pq.read_table(part)
    if how == "no id":
        t = t.drop_columns(["id"])
    elif how == "no status":
        t = t.drop_columns(["status"])
    elif how == "null id":
        ids = t["id"].to_pylist()
        t = t.set_column(0, pa.field("id", pa.string()), pa.array([None, *ids[1:]], pa.string()))
    elif how == "int id":
        t = t.set_column(0, "id", pa.array(range(t.num_rows)))
    elif how == "no prompt":
        t = t.drop_columns(["prompt"])
    elif how == "text request_index":
        t = t.set_column(t.schema.get_field_index("request_index"), "request_index", pa.array(["x"] * t.num_rows))
    else:
        part.parent.joinpath(HEX_PART).write_bytes(b"PAR1 not really")
        return
    pq.write_table(t, part.parent / HEX_PART)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("how", "says"), [
    ("no id", "no 'id' column: not a part of a vlbatch run"),
    ("no status", "no 'status' column: not a part of a vlbatch run"),
    ("null id", "1 row(s) with a null 'id': not a part of a vlbatch run"),
    ("int id", "its 'id' column is int64, not text"),
    ("not parquet", "not a Parquet file"),
    ("no prompt", "no 'prompt' column: not a part of a vlbatch run"),
    ("text request_index", "its 'request_index' column is string, not int32 (Failed to parse string: 'x'"),
])
def test_a_part_without_a_usable_id_or_status_is_one_line_and_exit_1(run, tmp_path, capsys, layout, how, says):
    _damaged(_parts(run)[0], how)
    dest = tmp_path / "x.parquet"
    code, out, err = _export(capsys, run, dest, layout)
    assert code == 1 and out == ""
    assert err.startswith(f"vlbatch export: nothing written to {dest}: {run / HEX_PART}: ") and err.count("\n") == 1
    assert says in err and "Traceback" not in err
    assert not dest.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith("x.")] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_copied_part_counts_once_ids_are_unique_in_every_export(run, tmp_path, capsys, layout):
    want = _clean(capsys, run, tmp_path, layout)
    for i, part in enumerate(_parts(run)):
        shutil.copy(part, run / f"part-{'e' * 23}{i}.parquet")  # every row twice
    dest = tmp_path / "x.parquet"
    code, out, err = _export(capsys, run, dest, layout)
    assert code == 0, err
    assert out.startswith("exported 13 rows")
    got = pq.read_table(dest)
    assert got.num_rows == want.num_rows and got.equals(want)
    if layout == "rows":
        assert len(set(got["id"].to_pylist())) == got.num_rows


def test_a_done_row_wins_over_an_earlier_transient_copy_of_its_id(run, tmp_path, capsys):
    """The rule the run's seal keeps (`sink/dedupe.py`): a done row before a transient error row, whatever
    the part order."""
    first = _parts(run)[0]
    t = pq.read_table(first).slice(0, 1)
    err_row = t.set_column(t.schema.get_field_index("status"), "status", pa.array(["error"]))
    err_row = err_row.set_column(t.schema.get_field_index("error_type"), "error_type", pa.array(["StorageError"]))
    pq.write_table(err_row, run / f"part-{'0' * 24}.parquet")  # first in name order
    dest = tmp_path / "x.parquet"
    code, out, err = _export(capsys, run, dest, "rows")
    assert code == 0 and out.startswith("exported 13 rows"), err
    rows = {r["id"]: r for r in pq.read_table(dest).to_pylist()}
    assert len(rows) == 13 and rows[t["id"][0].as_py()]["status"] == "ok"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bad", ["text", "type"])
def test_a_parsed_value_that_is_not_json_is_one_line_and_exit_1(run, tmp_path, capsys, layout, bad):
    part = next(p for p in _parts(run) if pq.read_table(p)["parsed"].null_count < pq.read_table(p).num_rows)
    t = pq.read_table(part)
    i = t.schema.get_field_index("parsed")
    values = t["parsed"].to_pylist()
    k = next(j for j, v in enumerate(values) if v is not None)
    if bad == "text":
        values[k] = '{"count": 2, "te'
        t = t.set_column(i, t.schema.field(i), pa.array(values, pa.string()).cast(t.schema.field(i).type))
        says = f"{part}: row {t['id'][k].as_py()}: its parsed value is not JSON ("
    else:
        t = t.set_column(i, "parsed", pa.array([None if v is None else 7 for v in values], pa.int64()))
        says = f"{part}: its 'parsed' column is int64, not JSON text"
    pq.write_table(t, part)
    dest = tmp_path / "x.parquet"
    code, out, err = _export(capsys, run, dest, layout)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"vlbatch export: nothing written to {dest}: {says}")
    assert not dest.exists()
