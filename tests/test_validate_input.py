"""Issue 50: `vlbatch validate` reads the input as `run` will; storage problems are exit 2.

- a configured column (media, an explicit media_type, questions, keep) that the manifest does not
  have is refused by the preflight's input step, naming the field and listing the columns there are
  (Parquet footer, the first lines of JSONL / CSV, the first sample of a WebDataset shard); on main
  a wrong `input.columns.media` passed validate and the run made every line an InputError row;
- validate prints one input line: the media count where it is known cheaply, else "unknown until read";
- a storage problem found by the preflight (no credentials for the output bucket, the input's
  listing) is exit 2 and one line naming the field (on main: exit 1, `StorageError: ...`).
Real parts: real manifests on disk, a tiny checkpoint, moto's S3 server, the CLI's `main`; no Ray.
"""
from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import validate_config


def _cfg(tmp_path, uri, fmt, **columns):
    task = {"mode": "questions"} if columns.get("questions") else {}
    return validate_config({"model": {"path": "m"}, "input": {"uri": str(uri), "format": fmt, "columns": columns},
                            "task": task, "output": {"uri": str(tmp_path / "out")}})


def _check(cfg):
    """The preflight's input step alone: the source opened, its columns checked."""
    from vlbatch.pipeline.plan.preflight import check_input

    return check_input(cfg)


def _job(tmp_path, tiny_ckpt):
    from test_jobs_support import write_job

    return write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2)


def test_validate_refuses_a_wrong_media_column_of_a_jsonl_manifest(tmp_path, tiny_ckpt, capsys):
    """End to end, as a user runs it: on main validate said `valid` and the run made 2 InputError rows."""
    from vlbatch.jobs.cli import main

    path = _job(tmp_path, tiny_ckpt)
    capsys.readouterr()  # the checkpoint's making
    assert main(["validate", str(path), "--set", "input.columns.media=image_path"]) == 2
    err = capsys.readouterr().err
    assert "input.columns.media: " in err and "'image_path'" in err, err
    assert "columns are: media_uri, media_type" in err, err
    assert main(["validate", str(path)]) == 0  # the right name: valid, and the input line
    out = capsys.readouterr().out
    assert "  input: 2 media (jsonl lines counted)" in out, out


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_each_configured_column_must_exist(tmp_path, fmt):
    rows = {"uri": ["a.png", "b.png"], "qs": ['["q?"]', '["r?"]'], "label": ["x", "y"]}
    path = tmp_path / f"m.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.table(rows), path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(dict(zip(rows, r, strict=True))) + "\n" for r in zip(*rows.values(), strict=True)))
    else:
        path.write_text("uri,qs,label\n" + "".join(f"{a},\"{b.replace(chr(34), 2 * chr(34))}\",{c}\n"
                                                   for a, b, c in zip(*rows.values(), strict=True)))
    _check(_cfg(tmp_path, path, fmt, media="uri", questions="qs", keep=["label"]))  # all there: no error
    _check(_cfg(tmp_path, path, fmt, media="uri"))  # the default media_type column may be absent
    for field, bad in (("media", {"media": "url"}), ("media_type", {"media": "uri", "media_type": "kind"}),
                       ("questions", {"media": "uri", "questions": "question"}),
                       ("keep", {"media": "uri", "keep": ["label", "lable"]})):
        with pytest.raises(ConfigError) as e:
            _check(_cfg(tmp_path, path, fmt, **bad))
        assert f"input.columns.{field}: " in str(e.value), str(e.value)
        assert "columns are: uri, qs, label" in str(e.value), str(e.value)


def test_a_manifest_that_cannot_be_read_is_refused_naming_input_uri(tmp_path):
    """On main a file that is not Parquet failed validate with pyarrow's traceback."""
    path = tmp_path / "m.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"^input.uri: .*m.parquet cannot be read as parquet"):
        _check(_cfg(tmp_path, path, "parquet"))


def test_a_jsonl_schema_is_read_from_its_first_lines_only(tmp_path):
    """Bounded: the columns come from the first `SAMPLE_LINES` lines; a manifest whose first lines are
    all bad gives no schema to check against (the run makes their error rows), so nothing is refused."""
    from vlbatch.pipeline.sources.text import SAMPLE_LINES

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"uri": "a.png"}) + "\n" + "not json\n" * SAMPLE_LINES
                    + json.dumps({"uri": "b.png", "late": 1}) + "\n")
    _check(_cfg(tmp_path, path, "jsonl", media="uri"))
    with pytest.raises(ConfigError, match=r"input.columns.keep: .*'late'"):
        _check(_cfg(tmp_path, path, "jsonl", media="uri", keep=["late"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    _check(_cfg(tmp_path, bad, "jsonl", media="wrong"))


def _shard(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_webdataset_keep_names_members_of_the_first_sample(tmp_path):
    _shard(tmp_path / "s-0.tar", [("k1.jpg", b"x"), ("k1.txt", b"a cat"), ("k2.jpg", b"y"), ("k2.json", b"{}")])
    _check(_cfg(tmp_path, tmp_path / "s-0.tar", "webdataset", keep=["txt"]))
    with pytest.raises(ConfigError) as e:
        _check(_cfg(tmp_path, tmp_path / "s-{0..0}.tar", "webdataset", keep=["txt", "caption"]))
    assert "input.columns.keep: " in str(e.value) and "'caption'" in str(e.value), str(e.value)
    assert "members are: jpg, txt" in str(e.value), str(e.value)


@pytest.mark.parametrize(("fmt", "line"), [("parquet", "2 media (parquet metadata)"),
                                           ("glob", "2 media (glob listing)"),
                                           ("csv", "media unknown until read (csv)")])
def test_validate_prints_the_media_count_where_it_is_known(tmp_path, tiny_ckpt, capsys, fmt, line):
    from vlbatch.jobs.cli import main

    path = _job(tmp_path, tiny_ckpt)
    media = sorted((tmp_path / "wd" / "media").glob("*.png"))
    if fmt == "parquet":
        uri = tmp_path / "wd" / "m.parquet"
        pq.write_table(pa.table({"media_uri": [str(p) for p in media]}), uri)
    elif fmt == "csv":
        uri = tmp_path / "wd" / "m.csv"
        uri.write_text("media_uri\n" + "".join(f"{p}\n" for p in media))
    else:
        uri = tmp_path / "wd" / "media" / "*.png"
    assert main(["validate", str(path), "--set", f"input.uri={uri}", "--set", f"input.format={fmt}"]) == 0
    out = capsys.readouterr().out
    assert f"  input: {line}\n" in out, out


@pytest.fixture
def no_credentials(monkeypatch):
    """No AWS credentials anywhere the standard chain looks (env, files, instance metadata)."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("field", ["output.uri", "input.uri"])
def test_a_storage_problem_in_the_preflight_is_exit_2_naming_the_field(s3_server, tmp_path, tiny_ckpt, capsys,
                                                                       no_credentials, field):
    """moto's S3 server, no credentials: on main validate exited 1 with `StorageError: ...`."""
    from vlbatch.jobs.cli import main

    path = _job(tmp_path, tiny_ckpt)
    capsys.readouterr()  # the checkpoint's making
    value = "s3://no-creds-out/out" if field == "output.uri" else "s3://no-creds-in/m.jsonl"
    # a region of its own: storage options no S3 filesystem cached (with credentials) by another test has
    sets = ["--set", f"{field}={value}", "--set", f"storage.endpoint_url={s3_server.endpoint_url}",
            "--set", "storage.region=eu-north-1", "--set", "storage.retries=1"]
    assert main(["validate", str(path), *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vlbatch: {field}: ") and "NoCredentialsError" in err, err
    assert len(err.splitlines()) == 1, err


def test_a_line_pyarrow_cannot_read_is_no_schema_failure():
    """Python's json takes a lone surrogate ("\\ud800"), pyarrow's reader does not: such a line is an error row
    when it is read (tests/test_hardening_inputs_cli.py), never a refused input at validate."""
    from vlbatch.pipeline.sources.text import _json_schema

    schema = _json_schema([{"media_uri": "a.png", "question": "\ud800x"}, {"media_uri": "b.png", "k": 1}])
    assert schema.names == ["media_uri", "k"]
    assert _json_schema([{"media_uri": "\ud800"}]).names == []
