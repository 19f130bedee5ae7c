"""The input source contract (pipeline/sources/base.py), checked for every source on one small input.

Each source reads the same four media (two with a questions column where the format has one) on
the session's real local Ray (tests/conftest.py `ray_cluster`) and must give exactly the manifest
columns, manifest-relative paths resolved, `input.limit` applied, and `ConfigError` naming `input.uri`
when nothing is there.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlbatch.operators.errors import ConfigError

NAMES = ["a.png", "b.png", "c.mp4", "d.jpg"]


def _write(kind: str, folder) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for n in NAMES:
        (folder / n).write_bytes(b"x")
    rows = [{"media_uri": n, "questions": ["q1", "q2"] if i < 2 else None} for i, n in enumerate(NAMES)]
    if kind == "glob":
        return str(folder / "*.*")
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), folder / "m.parquet")
        return str(folder / "m.parquet")
    if kind == "jsonl":
        (folder / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder / "m.jsonl")
    (folder / "m.csv").write_text("media_uri\n" + "".join(n + "\n" for n in NAMES))
    return str(folder / "m.csv")


def _cfg(kind: str, uri: str, tmp_path, limit=None):
    from vlbatch.pipeline.config import JobConfig

    columns = {"questions": "questions"} if kind in ("parquet", "jsonl") else {}
    return JobConfig.model_validate({
        "model": {"path": str(tmp_path)}, "output": {"uri": str(tmp_path / "out")},
        "input": {"uri": uri, "format": kind, "limit": limit, "columns": columns},
        "task": {"mode": "questions" if columns else "caption"},
    })


@pytest.mark.ray
@pytest.mark.parametrize("kind", ["glob", "parquet", "jsonl", "csv"])
def test_source_gives_the_manifest_columns(ray_cluster, tmp_path, kind):
    from vlbatch.pipeline.sources import open_source
    from vlbatch.pipeline.sources.base import COLUMNS

    folder = tmp_path / "media"
    cfg = _cfg(kind, _write(kind, folder), tmp_path)
    rows = sorted(open_source(cfg).read(num_cpus=0.25).take_all(), key=lambda r: r["media_uri"])
    assert [tuple(sorted(r)) for r in rows] == [tuple(sorted(COLUMNS))] * 4
    assert [r["media_uri"] for r in rows] == [str(folder / n) for n in NAMES]  # relative paths resolved
    if kind in ("parquet", "jsonl"):
        assert [list(r["questions"]) if r["questions"] is not None else None for r in rows] == \
            [["q1", "q2"], ["q1", "q2"], None, None]
    limited = open_source(_cfg(kind, _write(kind, folder), tmp_path, limit=2)).read(num_cpus=0.25).take_all()
    assert len(limited) == 2


@pytest.mark.parametrize("kind", ["glob", "parquet", "jsonl"])
def test_source_refuses_an_input_that_is_not_there(tmp_path, kind):
    from vlbatch.pipeline.sources import open_source

    uri = str(tmp_path / ("none/*.png" if kind == "glob" else f"none.{kind}"))
    with pytest.raises(ConfigError, match="input.uri"):
        open_source(_cfg(kind, uri, tmp_path)).read()


@pytest.mark.ray
def test_jsonl_rows_missing_a_key_read_as_null(ray_cluster, tmp_path):
    """Ray Data's JSON reader hands a key missing from some lines over as NaN (through pandas):
    those cells must read as missing (null questions, null media_type), not as a float."""
    from vlbatch.pipeline.sources import open_source

    lines = [{"media_uri": "a.png"}, {"media_uri": None}, {"media_uri": "b.png", "questions": ["x", "y"],
                                                           "media_type": "image"}, {"media_uri": ""}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = _cfg("jsonl", str(path), tmp_path)
    cfg = cfg.model_copy(update={"input": cfg.input.model_copy(update={"columns": cfg.input.columns.model_copy(
        update={"media_type": "media_type"})})})
    rows = open_source(cfg).read(num_cpus=0.25).take_all()
    got = {r["media_uri"]: (r["media_type"], None if r["questions"] is None else list(r["questions"])) for r in rows}
    assert got == {str(tmp_path / "a.png"): (None, None), None: (None, None),
                   str(tmp_path / "b.png"): ("image", ["x", "y"]), "": (None, None)}
