"""Issue 48, items 5, 6 and 8: a remote manifest never reaches local files (nor a glob a symlink out
of its root), error messages quote no file contents, a bad line with `input.columns.keep` is one
`InputError` row, and every manifest line is accounted for (null / missing media, rows of one media
that differ in their kept columns, paths normalised before hashing).

Ray-free: the sources' block functions are called directly (`text.read_text_files`, the glob's
`manifest`), with a real loopback HTTP server for the remote manifest."""
from __future__ import annotations

import json
import os
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pyarrow as pa
import pytest

from vlbatch.operators.errors import MediaError


def _cfg(tmp_path, uri, fmt="jsonl", **extra):
    from vlbatch.pipeline.config import validate_config

    raw = {"model": {"path": str(tmp_path)}, "output": {"uri": str(tmp_path / "out")},
           "input": {"uri": str(uri), "format": fmt}, "task": {"mode": "caption"}}
    for section, values in extra.items():
        raw[section] = {**raw.get(section, {}), **values}
    return validate_config(raw)


def _read_rows(cfg) -> list[dict]:
    """The manifest rows of `cfg`'s source, read as its read tasks read them (no Ray)."""
    from vlbatch.pipeline.sources import open_source
    from vlbatch.pipeline.sources.text import read_text_files

    src = open_source(cfg)
    files = pa.table({"path": src._text_files})
    blocks = read_text_files(files, cfg=cfg, base_uri=src._base, keep=src.keep_schema())
    return [r for b in blocks for r in b.to_pylist()]


def _expand(rows: list[dict], cfg):
    from vlbatch.pipeline.sources.base import COLUMNS
    from vlbatch.pipeline.stages.requests import expand_all

    return expand_all([tuple(r[c] for c in COLUMNS) for r in rows], cfg.task)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


@pytest.fixture()
def www(tmp_path):
    root = tmp_path / "www"
    (root / "ds").mkdir(parents=True)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


# -- item 5: remote manifests and links never reach local files ----------------------------------

def test_remote_manifest_naming_a_local_file_is_an_error_row_never_read(www, tmp_path):
    from vlbatch.pipeline.stages.decode import DecodeStage

    root, url = www
    secret = tmp_path / "secret.png"
    os.mkfifo(secret)  # a read of it would block: the test proves no one opens it by finishing
    entries = [f"file://{secret}", f"FILE://{secret}", f"local://{secret}", "s3://bucket/x.png",
               f"{url}/other/ok.png", "ok2.png"]
    (root / "ds" / "m.jsonl").write_text("".join(json.dumps({"media_uri": e}) + "\n" for e in entries))
    cfg = _cfg(tmp_path, f"{url}/ds/m.jsonl")
    rows = _read_rows(cfg)
    errors = {r["media_uri"]: r["error"] for r in rows if r["error"]}
    assert sorted(errors) == sorted(entries[:4])
    for e in errors.values():
        assert "remote manifest" in e and "storage.allow_schemes" in e, e
    assert [r["media_uri"] for r in rows if not r["error"]] == [f"{url}/other/ok.png", f"{url}/ds/ok2.png"]
    tasks, _ = _expand(rows, cfg)
    refused = [t for t in tasks if t.media_uri == f"file://{secret}"]
    assert [(t.status, t.error_type) for t in refused] == [("error", "InputError")]
    decoded = DecodeStage(cfg).decode_one(refused[0])  # the decode stage passes it on unread
    assert decoded.status == "error" and "remote manifest" in decoded.error_message
    # an allow-list in `storage` lets a remote manifest name another scheme, deliberately
    allowed = _read_rows(_cfg(tmp_path, f"{url}/ds/m.jsonl", storage={"allow_schemes": ["s3"]}))
    assert [r["error"] for r in allowed if r["media_uri"] == "s3://bucket/x.png"] == [None]


def test_allow_schemes_names_only_known_schemes(tmp_path):
    from vlbatch.operators.errors import ConfigError

    with pytest.raises(ConfigError, match="storage.allow_schemes"):
        _cfg(tmp_path, tmp_path / "m.jsonl", storage={"allow_schemes": ["gopher"]})


def _glob_tree(tmp_path):
    root, out = tmp_path / "imgs", tmp_path / "elsewhere"
    (root / "sub").mkdir(parents=True)
    out.mkdir()
    (root / "a.png").write_bytes(b"a")
    (out / "passwd.png").write_bytes(b"root:x:0:0")
    (root / "x.png").symlink_to(out / "passwd.png")  # out of the root
    (root / "sub" / "in.png").symlink_to(root / "a.png")  # inside the root: fine
    return root


@pytest.mark.parametrize("pattern", ["", "*.png"])
def test_glob_follows_no_symlink_out_of_its_root(tmp_path, pattern):
    from vlbatch.pipeline.sources.glob import GlobSource

    root = _glob_tree(tmp_path)
    uri = f"{root}/{pattern}" if pattern else str(root)
    rows = {r["media_uri"]: r["error"] for r in GlobSource(_cfg(tmp_path, uri, "glob")).manifest().to_pylist()}
    link = str(root / "x.png")
    assert rows[link] and "outside" in rows[link] and "input.follow_symlinks" in rows[link]
    assert rows[str(root / "a.png")] is None
    if not pattern:
        assert rows[str(root / "sub" / "in.png")] is None
    follow = _cfg(tmp_path, uri, "glob", input={"follow_symlinks": True})
    followed = GlobSource(follow).manifest().to_pylist()
    # a run that follows links is another run (its refused rows are not resumed), the default's id is unchanged
    assert follow.resolved_run_id() != _cfg(tmp_path, uri, "glob").resolved_run_id()
    assert all(r["error"] is None for r in followed) and link in [r["media_uri"] for r in followed]


def test_a_non_image_error_quotes_no_bytes_of_the_file():
    from vlbatch.operators.media.image import load_image

    secret = b"root:x:0:0:root:/root:/bin/bash\n"
    with pytest.raises(MediaError) as e:
        load_image(secret)
    msg = str(e.value)
    assert f"{len(secret)} bytes" in msg
    assert secret[:8].hex() not in msg and "root" not in msg


# -- item 6: a bad line with input.columns.keep ----------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_bad_line_with_keep_is_one_error_row(tmp_path, fmt):
    if fmt == "jsonl":
        body = (json.dumps({"media_uri": "a.png", "source_id": 1}).encode() + b"\n{not json\n"
                + json.dumps({"media_uri": "c.png", "source_id": 3}).encode() + b"\n")
    else:  # line 3: bytes that are not UTF-8; line 4: a cell too many (pyarrow's CSV reader refuses both)
        body = b"media_uri,source_id\na.png,1\nb\xff.png,2\nc.png,3,extra\n"
    path = tmp_path / f"m.{fmt}"
    path.write_bytes(body)
    cfg = _cfg(tmp_path, path, fmt, input={"columns": {"keep": ["source_id"]}})
    rows = _read_rows(cfg)
    bad = [r for r in rows if r["error"]]
    good = [r for r in rows if not r["error"]]
    line = 2 if fmt == "jsonl" else 3
    assert [r["identity"] for r in bad] == [f"{path}#L{line}"] and f"line {line}" in bad[0]["error"]
    assert [r["media_uri"] for r in good] == [str(tmp_path / "a.png"), str(tmp_path / "c.png")]
    from vlbatch.pipeline.sources.keep import decode

    kept = decode([r["keep"] for r in good], [1, 1], pa.schema([("source_id", pa.int64())]))
    assert kept.column("source_id").to_pylist() == [1, 3]


def test_keep_types_come_from_the_good_lines(tmp_path):
    from vlbatch.pipeline.sources import open_source

    path = tmp_path / "m.jsonl"
    path.write_text("[1, 2]\n" + json.dumps({"media_uri": "a.png", "source_id": 1, "tag": "x"}) + "\n")
    cfg = _cfg(tmp_path, path, input={"columns": {"keep": ["source_id", "tag"]}})
    assert open_source(cfg).keep_schema() == pa.schema([("source_id", pa.int64()), ("tag", pa.string())])


# -- item 8: every manifest line accounted for -----------------------------------------------------

def test_null_and_missing_media_are_error_rows_with_their_line_numbers(tmp_path):
    from vlbatch.pipeline.stages.requests import request_id

    lines = [{"media_uri": f"i{i}.png"} for i in range(13)]
    lines += [{"other": 1}, {"media_uri": None}, {"media_uri": ""}, {"media_uri": "./a.png"}, {"media_uri": "a.png"}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = _cfg(tmp_path, path)
    tasks, dropped = _expand(_read_rows(cfg), cfg)
    assert len(tasks) + dropped == len(lines) == 18
    assert dropped == 1  # ./a.png and a.png: one media, named once
    errors = [t for t in tasks if t.status == "error"]
    assert [t.error_type for t in errors] == ["InputError"] * 3
    for t, n, what in zip(errors, (14, 15, 16), ("missing", "null", "empty"), strict=True):
        assert f"line {n}" in t.error_message and what in t.error_message, t.error_message
    assert errors[2].media_uri == ""  # an error row keeps the manifest's value
    assert len({t.ids[0] for t in tasks}) == len(tasks)
    # ordinary rows keep the ids they always had
    assert tasks[0].ids == (request_id(str(tmp_path / "i0.png"), 0, cfg.task.prompt),)


def test_null_media_in_parquet_rows_are_separate_error_rows(tmp_path):
    from vlbatch.pipeline.sources.cells import normalise

    cfg = _cfg(tmp_path, tmp_path / "m.parquet", "parquet")
    t = normalise(pa.table({"media_uri": ["a.png", None, None, ""]}), cfg, str(tmp_path),
                  file_uri=str(tmp_path / "m.parquet"), row_offset=10)
    tasks, dropped = _expand(t.to_pylist(), cfg)
    assert dropped == 0 and [t.status for t in tasks] == ["ok", "error", "error", "error"]
    assert ["row 11" in t.error_message for t in tasks[1:]] == [True, False, False]
    assert len({t.ids[0] for t in tasks}) == 4


def _keep_blob(source_id: int) -> bytes:
    from vlbatch.pipeline.sources.keep import encode

    return encode(pa.table({"source_id": [source_id]}))[0]


def test_rows_of_one_media_with_different_keep_columns_are_separate_rows(tmp_path):
    from vlbatch.pipeline.stages.requests import expand_all, request_id

    cfg = _cfg(tmp_path, tmp_path / "m.jsonl")
    records = [("/m/a.png", None, None, None, None, None, _keep_blob(i)) for i in range(50)]
    records += [("/m/a.png", None, None, None, None, None, _keep_blob(7))]  # the same as row 7: a duplicate
    records += [("/m/b.png", None, None, None, None, None, _keep_blob(1))] * 2
    tasks, dropped = expand_all(records, cfg.task)
    assert len(tasks) == 51 and dropped == 2
    assert [t.keep for t in tasks[:50]] == [_keep_blob(i) for i in range(50)]
    assert len({t.ids[0] for t in tasks}) == 51
    assert tasks[0].ids == (request_id("/m/a.png", 0, cfg.task.prompt),)  # the first keeps its ordinary id
    assert tasks[50].ids == (request_id("/m/b.png", 0, cfg.task.prompt),)
    again, _ = expand_all(records, cfg.task)  # a rerun computes the same ids (resume)
    assert [t.ids for t in again] == [t.ids for t in tasks]


def test_paths_are_normalised_before_hashing():
    from vlbatch.pipeline.sources.cells import resolve

    assert resolve("/data/./x/../a.png", "/m") == "/data/a.png"
    assert resolve("file:///data/./a.png", "/m") == "file:///data/a.png"
    assert resolve("https://h/a/./b/../c.png", "https://h/m") == "https://h/a/c.png"
    assert resolve("s3://b/./a.png", "s3://b/m") == "s3://b/./a.png"  # an S3 key is opaque: './' is its own key


def test_the_final_line_names_dropped_duplicates():
    from vlbatch.jobs.local import summary_line

    s = SimpleNamespace(processed_by_status={"ok": 3}, requests_skipped=0, output_dir="/o/r", elapsed_s=1.0,
                        exceeded_error_fraction=False, duplicates_dropped=49, errors_text=lambda: None)
    assert "49 duplicate requests dropped" in summary_line(s)
    assert "duplicate" not in summary_line(SimpleNamespace(**{**vars(s), "duplicates_dropped": 0}))



def test_inspect_previews_no_media_the_run_refused_to_read(tmp_path):
    """`vlbatch inspect --html` thumbnails the sampled and error rows' media on the inspecting
    machine: a media the run refused as an `InputError` (a remote manifest's file:// entry) must
    not be read there either."""
    from vlbatch.jobs.inspect.html import preview_media

    secret = tmp_path / "secret.png"
    refused = {"media_uri": f"file://{secret}", "media_type": "image", "status": "error",
               "error_type": "InputError", "error_message": "a remote manifest ..."}
    blank_q = {"media_uri": "/m/a.png", "media_type": "image", "status": "error", "error_type": "InputError"}
    ok = {"media_uri": "/m/a.png", "media_type": "image", "status": "ok", "error_type": None}
    rep = SimpleNamespace(sample=[refused, ok, blank_q], error_media={"InputError": [refused, blank_q]})
    read, not_read = preview_media(rep, max_thumbs=10)
    assert read == {"/m/a.png": "image"}  # another row of that media ran: it is previewed
    assert not_read == {f"file://{secret}"}
