"""Issue 31, item 4: one bad manifest line is one `InputError` row (its line number the id source), the
job goes on; blank questions are error rows; a lone surrogate is never silently changed."""
from __future__ import annotations

import json

import pytest

GOOD = json.dumps({"media_uri": "a.png", "questions": ["What?"]})


def _cfg(uri, kind, tmp_path):
    from vlbatch.pipeline.config import validate_config

    return validate_config({"model": {"path": str(tmp_path)}, "output": {"uri": str(tmp_path / "out")},
                            "input": {"uri": str(uri), "format": kind, "columns": {"questions": "questions"}},
                            "task": {"mode": "questions", "questions": ["default?"]}})


def _read(cfg):
    from vlbatch.pipeline.sources import open_source

    return open_source(cfg).read(num_cpus=0.25).take_all()


@pytest.mark.ray  # Ray Data reads the manifest (the session's Ray)
def test_bad_jsonl_lines_are_error_rows_and_the_rest_is_read(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [GOOD.encode(),  # 1
             b'["a.png", "What?"]',  # 2: a JSON array
             b'{"media_uri": "b\xff\xfe.png"}',  # 3: raw bytes that are not UTF-8
             b'{"media_uri": "c.png", "questions": ["\\ud800 what?"]}',  # 4: a lone surrogate (escaped)
             b"",  # 5: blank, skipped
             b'{"media_uri": 7}',  # 6: not a string
             b"{not json",  # 7
             json.dumps({"media_uri": "d.png", "questions": ["ok?", "", "  ", None]}).encode()]  # 8
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = _read(_cfg(path, "jsonl", tmp_path))
    by_line = {r["identity"].rsplit("#L", 1)[1]: r for r in rows if r["identity"]}
    assert sorted(by_line) == ["2", "3", "4", "6", "7"]
    assert all(r["media_uri"] is None and f"m.jsonl line {n}:" in r["error"] for n, r in by_line.items())
    assert "array" in by_line["2"]["error"] and "UTF-8" in by_line["3"]["error"]
    assert "surrogate" in by_line["4"]["error"] and "not a string" in by_line["6"]["error"]
    good = {r["media_uri"]: r for r in rows if not r["identity"]}
    assert sorted(good) == [str(tmp_path / "a.png"), str(tmp_path / "d.png")]
    assert good[str(tmp_path / "d.png")]["questions"] == ["ok?", "", "  ", ""]  # blanks kept for expansion


@pytest.mark.ray  # Ray Data reads the manifest (the session's Ray)
def test_a_lone_surrogate_in_a_csv_questions_cell_is_an_error_row(tmp_path):
    path = tmp_path / "m.csv"
    path.write_bytes(b'media_uri,questions\na.png,"[""What?""]"\nb.png,"[""\\ud800""]"\nc\xff.png,\nd.png,\n')
    rows = _read(_cfg(path, "csv", tmp_path))
    errs = {r["identity"]: r["error"] for r in rows if r["error"]}
    assert set(errs) == {f"{path}#L3", f"{path}#L4"}
    assert "surrogate" in errs[f"{path}#L3"] and "not valid Unicode" in errs[f"{path}#L4"]
    ok = {r["media_uri"]: r["questions"] for r in rows if not r["error"]}
    assert ok == {str(tmp_path / "a.png"): ["What?"], str(tmp_path / "d.png"): None}  # an empty cell: none given


def test_blank_questions_become_error_rows_and_do_not_shift_ids():
    from vlbatch.pipeline.config import TaskSection
    from vlbatch.pipeline.stages.requests import expand_all, request_id

    task = TaskSection(mode="questions", questions=["default?"])
    rows, _ = expand_all([("/m/a.png", None, ["What?", "", "  ", "Why?"]), ("/m/b.png", None, ["", " "])], task)
    got = [(r.media_uri, r.status, r.error_type, r.request_indices, r.prompts) for r in rows]
    assert got == [("/m/a.png", "ok", None, (0, 3), ("What?", "Why?")),
                   ("/m/a.png", "error", "InputError", (1, 2), ("", "  ")),
                   ("/m/b.png", "error", "InputError", (0, 1), ("", " "))]
    assert rows[0].ids == (request_id("/m/a.png", 0, "What?"), request_id("/m/a.png", 3, "Why?"))
    assert "empty or only whitespace" in rows[1].error_message
    # a bad manifest line: its identity (`<file>#L<n>`) names the requests, task.questions apply
    (bad,), _ = expand_all([(None, None, None, None, "/m/x.jsonl#L2", "line 2: a JSON array", None)], task)
    assert bad.error_type == "InputError" and bad.ids == (request_id("/m/x.jsonl#L2", 0, "default?"),)


def test_webdataset_member_over_max_bytes_is_never_read(tmp_path):
    """Issue 31, item 7: the tar header's size is checked against image.max_bytes before the member is
    read; the stream skips it (peak Python memory far below the member), and the next sample reads."""
    import io
    import tarfile
    import tracemalloc

    from vlbatch.operators.storage import StorageOptions
    from vlbatch.pipeline.sources.webdataset import MemberLimits, read_shard

    big = 96 << 20  # the stream's own buffers (ranged reads of 8 MiB) stay below half of it
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in (("000.jpg", b"\0" * big), ("000.txt", b"caption"), ("001.png", b"small"),
                           ("001.json", b"{}" * 1000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tracemalloc.start()
    rows = list(read_shard(str(shard), StorageOptions(), ("txt",), MemberLimits(image=1 << 20)))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < big // 2, f"peak {peak} B: the member was read"
    assert rows[0]["identity"] == "000" and "over the image.max_bytes limit of 1048576" in rows[0]["error"]
    assert not rows[0].get("media_bytes")
    assert rows[1]["identity"] == "001" and rows[1]["media_bytes"] == b"small" and "error" not in rows[1]
