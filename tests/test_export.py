"""`vlbatch export` (issue 52): a run folder made through the real sink (two parts, one media's rows split
over both, a JSON-schema prompt, a choice prompt, a free question, a caption, error rows, kept columns, a
clipped video) and its `_fingerprint.json` written by the real `record_fingerprint`; the media layout's
types and values checked with pyarrow; the rows layout round-tripped in each format; an s3:// DEST on
moto's server (`s3_server` in conftest); the two-pass bucketing bounded by the bucket size."""
from __future__ import annotations

import csv
import io
import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlbatch.jobs.cli import main
from vlbatch.jobs.export.command import export
from vlbatch.jobs.export.media import bucket_tables, make_spec, named, pivot
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OUTPUT_SCHEMA, OutputRow, rows_to_table
from vlbatch.operators.storage import StorageOptions
from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.plan.fingerprint import record_fingerprint
from vlbatch.pipeline.sources.keep import output_schema

RUN_ID = "export-test"
TAGS = {"type": "object", "properties": {
    "count": {"type": "integer"}, "text": {"type": "boolean"},
    "labels": {"type": "array", "items": {"type": "string"}},
    "shape": {"enum": ["circle", "square", "triangle"]}},
    "required": ["count", "text", "labels", "shape"], "additionalProperties": False}
QUESTIONS = ["How many people?",
             {"name": "tags", "prompt": "Tag it.", "response_format": {"type": "json_schema", "schema": TAGS}},
             {"name": "has_text", "prompt": "Text?", "response_format": {"type": "choice", "choices": ["yes", "no"]}}]
KEEP = pa.schema([pa.field("label", pa.string()), pa.field("score", pa.int64())])


def _config(out: str, endpoint: str | None = None, **task):
    return validate_config({"model": {"path": "m"}, "input": {"uri": "in.jsonl", "columns": {"keep": ["label", "score"]}},
                            "output": {"uri": out, "run_id": RUN_ID}, "storage": {"endpoint_url": endpoint},
                            "task": task or {"mode": "questions", "caption": True, "questions": QUESTIONS}})


def _row(uri, idx, name, status="ok", answer=None, parsed=None, kind="image", clip=None, err=None):
    c = {} if clip is None else {"clip_index": clip, "clip_start_s": 2.0 * clip, "clip_end_s": 2.0 * clip + 2,
                                 "clip_source": "fixed", "clip_uri": f"out/{RUN_ID}/clips/{clip}.mp4"}
    return OutputRow(id=uuid.uuid5(uuid.NAMESPACE_URL, f"{uri}#{clip}#{idx}").hex, request_index=idx, media_uri=uri,
                     media_type=kind, prompt=f"prompt {idx}", prompt_name=name, status=status, model="tiny",
                     run_id=RUN_ID, answer=answer, parsed=parsed, error_type=err,
                     error_message=None if err is None else f"{err} happened",
                     quality_flags=() if status == "ok" else None, **c)


A_TAGS = {"count": 2, "text": True, "labels": ["red", "box"], "shape": "square"}
PART1 = [_row("a.png", 0, "q0", answer="Two."), _row("a.png", 1, "tags", answer=json.dumps(A_TAGS),
                                                      parsed=json.dumps(A_TAGS)),
         _row("b.png", 0, "q0", answer="None."),
         _row("b.png", 1, "tags", "error", answer='{"count": 1, "te', err="TruncatedError"),
         _row("b.png", 2, "has_text", answer="no", parsed='"no"'),
         _row("c.png", 1, "tags", answer="{}", parsed='{"count": "many", "text": true, "labels": [], "shape": "circle"}'),
         _row("v.mp4", 3, "caption", answer="A square moves.", kind="video", clip=0),
         _row("v.mp4", 3, "caption", answer="It stops.", kind="video", clip=1)]
PART2 = [_row("a.png", 2, "has_text", answer="yes", parsed='"yes"'), _row("a.png", 3, "caption", answer="A red box."),
         _row("d.png", 0, "q0", "error", err="MediaError"), _row("d.png", 3, "caption", "error", err="MediaError"),
         _row("v.mp4", 0, "q0", answer="Nobody.", kind="video", clip=1)]
LABELS = {"a.png": ("red", 1), "b.png": ("blue", 2), "c.png": (None, 3), "d.png": ("bad", 4), "v.mp4": ("vid", 5)}


def _commit(sink: ParquetSink, rows: list[OutputRow]) -> None:
    t = rows_to_table(rows)
    labels = [LABELS[r.media_uri] for r in rows]
    t = t.append_column("label", pa.array([x[0] for x in labels])).append_column("score", pa.array([x[1] for x in labels]))
    sink.commit(t)


def make_run(out: str, storage=None, fingerprint: bool = True) -> str:
    run = f"{out}/{RUN_ID}"
    sink = ParquetSink(run, storage or StorageOptions(), schema=output_schema(KEEP))
    sink.prepare()
    _commit(sink, PART1)
    _commit(sink, PART2)
    if fingerprint:
        record_fingerprint(_config(out, storage and storage.endpoint_url))
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(str(tmp_path_factory.mktemp("export") / "out"))


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["export", *map(str, argv)])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_media_layout_is_one_typed_row_per_media_or_clip(run_dir, tmp_path, capsys):
    dest = tmp_path / "media.parquet"
    code, out, err = _cli(capsys, run_dir, "--layout", "media", "--format", "parquet", "-o", dest)
    assert code == 0, err
    assert out == f"exported 13 rows (5 media, 2 clips) to {dest}\n"  # 6 media rows: v.mp4's 2 clips are one media
    t = pq.read_table(dest)
    assert t.schema.field("tags").type == pa.struct([
        ("count", pa.int64()), ("labels", pa.list_(pa.string())),
        ("shape", pa.dictionary(pa.int32(), pa.string())), ("text", pa.bool_())])  # sorted by name
    assert t.schema.field("has_text").type == pa.dictionary(pa.int32(), pa.string())
    assert t.schema.field("caption").type == pa.string() and t.schema.field("q0").type == pa.string()
    assert t.schema.field("score").type == pa.int64() and t.schema.field("clip_index").type == pa.int32()
    assert t.column_names[:9] == ["media_uri", "media_type", "clip_index", "clip_start_s", "clip_end_s",
                                  "clip_source", "clip_uri", "caption", "caption_status"]
    rows = {(r["media_uri"], r["clip_index"]): r for r in t.to_pylist()}
    assert sorted(rows, key=str) == sorted([("a.png", None), ("b.png", None), ("c.png", None), ("d.png", None),
                                            ("v.mp4", 0), ("v.mp4", 1)], key=str)
    a = rows[("a.png", None)]  # its rows were in both parts
    assert a["tags"] == A_TAGS and a["tags_status"] == "ok"
    assert (a["has_text"], a["caption"], a["q0"], a["label"], a["score"]) == ("yes", "A red box.", "Two.", "red", 1)
    b = rows[("b.png", None)]
    assert (b["tags"], b["tags_status"], b["has_text"], b["caption_status"]) == (None, "error", "no", None)
    c = rows[("c.png", None)]  # an ok row whose value does not fit the type: null, error
    assert (c["tags"], c["tags_status"], c["label"]) == (None, "error", None)
    d = rows[("d.png", None)]
    assert (d["q0_status"], d["caption_status"], d["caption"]) == ("error", "error", None)
    v0, v1 = rows[("v.mp4", 0)], rows[("v.mp4", 1)]
    assert (v0["caption"], v0["q0"], v0["clip_start_s"], v0["clip_source"]) == ("A square moves.", None, 0.0, "fixed")
    assert (v1["caption"], v1["q0"], v1["clip_end_s"], v1["media_type"]) == ("It stops.", "Nobody.", 4.0, "video")
    assert (v1["clip_uri"], a["clip_uri"]) == (f"out/{RUN_ID}/clips/1.mp4", None)  # the clip's file; none for images


def test_media_layout_jsonl_nests_and_csv_holds_json_text(run_dir, tmp_path, capsys):
    for fmt in ("jsonl", "csv"):
        code, _, err = _cli(capsys, run_dir, "--format", fmt, "-o", tmp_path / f"m.{fmt}")
        assert code == 0, err
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    a = next(x for x in lines if x["media_uri"] == "a.png")
    assert a["tags"] == A_TAGS and a["has_text"] == "yes"
    cells = list(csv.DictReader(io.StringIO((tmp_path / "m.csv").read_text())))
    assert len(cells) == 6
    a = next(x for x in cells if x["media_uri"] == "a.png")
    assert json.loads(a["tags"]) == A_TAGS and a["has_text"] == "yes" and a["score"] == "1"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_rows_layout_round_trips(run_dir, tmp_path, capsys, fmt):
    dest = tmp_path / f"rows.{fmt}"
    code, out, err = _cli(capsys, run_dir, "--layout", "rows", "--format", fmt, "-o", dest)
    assert code == 0 and out == f"exported 13 rows to {dest}\n", err
    want = sorted((r.id, r.answer, r.parsed, r.status, r.prompt_name) for r in PART1 + PART2)
    if fmt == "parquet":
        t = pq.read_table(dest)
        assert t.schema.names == OUTPUT_SCHEMA.names + ["label", "score"]
        assert t.schema.field("parsed").type == OUTPUT_SCHEMA.field("parsed").type
        got = [(r["id"], r["answer"], r["parsed"], r["status"], r["prompt_name"]) for r in t.to_pylist()]
    elif fmt == "jsonl":
        rows = [json.loads(x) for x in dest.read_text().splitlines()]
        a = next(r for r in rows if r["prompt_name"] == "tags" and r["media_uri"] == "a.png")
        assert a["parsed"] == A_TAGS and a["quality_flags"] == [] and set(a["timings"]) == {"decode_s", "preprocess_s",
                                                                                         "model_s"}
        got = [(r["id"], r["answer"], None if r["parsed"] is None else json.dumps(r["parsed"]), r["status"],
                r["prompt_name"]) for r in rows]
        want = [(i, a, None if p is None else json.dumps(json.loads(p)), s, n) for i, a, p, s, n in want]
    else:
        rows = list(csv.DictReader(io.StringIO(dest.read_text())))
        assert json.loads(rows[0]["timings"]) == {"decode_s": None, "preprocess_s": None, "model_s": None}
        got = [(r["id"], r["answer"] or None, r["parsed"] or None, r["status"], r["prompt_name"]) for r in rows]
    assert sorted(got) == want


def test_bad_usage_is_exit_2_naming_the_option(run_dir, tmp_path, capsys):
    code, _, err = _cli(capsys, run_dir, "-o", f"{run_dir}/x.parquet")
    assert code == 2 and "-o" in err and "inside the run folder" in err
    bare = make_run(str(tmp_path / "bare"), fingerprint=False)
    code, _, err = _cli(capsys, bare, "-o", tmp_path / "x.parquet")
    assert code == 2 and "--config" in err and "_fingerprint.json" in err
    assert not (tmp_path / "x.parquet").exists()
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(_config(str(tmp_path / "bare")).model_dump(mode="json", by_alias=True)))
    code, out, err = _cli(capsys, bare, "--config", cfg, "-o", tmp_path / "x.parquet")
    assert code == 0 and "(5 media, 2 clips)" in out, err
    other = tmp_path / "other.yaml"
    other.write_text(json.dumps(_config(str(tmp_path / "bare"), mode="caption").model_dump(mode="json")))
    code, _, err = _cli(capsys, run_dir, "--config", other, "-o", tmp_path / "y.parquet")
    assert code == 2 and "task.mode" in err


def test_buckets_hold_each_media_whole_and_at_most_one_bucket_is_grouped(run_dir, tmp_path):
    sink = ParquetSink(run_dir)
    tables = [named(sink.read_part(p), False, KEEP) for p in sink.parts()]
    spec = make_spec(_config("o").task, {"q0", "tags", "has_text", "caption"}, KEEP)
    one = pivot(pa.concat_tables(tables), spec)
    buckets = list(bucket_tables(iter(tables), 13, 3, str(tmp_path)))  # 5 buckets of about 3 rows
    assert len(buckets) > 1 and max(b.num_rows for b in buckets) < 13
    seen: list[str] = []
    for b in buckets:
        uris = set(b["media_uri"].to_pylist())
        assert not uris & set(seen)  # a media's rows (from both parts) all in one bucket
        seen += uris
    assert not list(tmp_path.iterdir())  # each bucket file deleted once read
    many = pa.concat_tables([pivot(b, spec) for b in buckets])
    key = lambda r: (r["media_uri"], r["clip_index"] or 0)  # noqa: E731
    assert sorted(many.to_pylist(), key=key) == sorted(one.to_pylist(), key=key)


@pytest.mark.slow
def test_export_to_s3_appears_whole(s3_server, tmp_path, capsys):
    bucket = f"export-{uuid.uuid4().hex[:8]}"
    s3_server.client().create_bucket(Bucket=bucket)
    storage = StorageOptions(endpoint_url=s3_server.endpoint_url)
    run = make_run(f"s3://{bucket}/out", storage)
    code, out, err = _cli(capsys, run, "--endpoint-url", s3_server.endpoint_url, "--bucket-rows", "4",
                          "-o", f"s3://{bucket}/exports/media.parquet")
    assert code == 0 and out.startswith("exported 13 rows (5 media, 2 clips)"), err
    body = s3_server.client().get_object(Bucket=bucket, Key="exports/media.parquet")["Body"].read()
    t = pq.read_table(io.BytesIO(body))
    assert t.num_rows == 6 and t.schema.field("tags").type.num_fields == 4
    done = export(run, layout="rows", fmt="jsonl", dest=f"s3://{bucket}/exports/rows.jsonl",
                  endpoint_url=s3_server.endpoint_url)
    body = s3_server.client().get_object(Bucket=bucket, Key="exports/rows.jsonl")["Body"].read()
    assert (done.rows, done.media, len(body.splitlines())) == (13, None, 13)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket, Prefix="exports/")["Contents"]]
    assert sorted(keys) == ["exports/media.parquet", "exports/rows.jsonl"]


def test_caption_mode_rows_without_a_name_are_the_caption_and_a_failure_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    sink = ParquetSink(f"{out}/{RUN_ID}", schema=output_schema(KEEP))
    sink.prepare()
    _commit(sink, [_row("a.png", 0, None, answer='"yes"', parsed='"yes"'), _row("b.png", 0, None, "error",
                                                                                 err="MediaError")])
    record_fingerprint(_config(str(out), mode="caption",
                               response_format={"type": "choice", "choices": ["yes", "no"]}))
    dest = tmp_path / "m.parquet"
    code, text, err = _cli(capsys, out, "-o", dest)  # the output.uri holding one run: that run
    assert code == 0 and "2 rows (2 media)" in text, err
    t = pq.read_table(dest)
    assert t.column_names[7:9] == ["caption", "caption_status"] and "q0" not in t.column_names
    assert t.schema.field("caption").type == pa.dictionary(pa.int32(), pa.string())
    assert sorted(t.select(["caption", "caption_status"]).to_pylist(), key=str) == sorted(
        [{"caption": "yes", "caption_status": "ok"}, {"caption": None, "caption_status": "error"}], key=str)
    code, _, err = _cli(capsys, out, "--bucket-rows", "0", "-o", dest)
    assert code == 2 and "--bucket-rows" in err
    (out / RUN_ID / "part-0000000000000000000000ff.parquet").write_bytes(b"not parquet")
    for fmt in ("parquet", "csv"):
        code, _, err = _cli(capsys, out, "--layout", "rows", "--format", fmt, "-o", tmp_path / f"bad.{fmt}")
        assert code == 1 and "nothing written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.parquet", "out"]  # no half file, no temp file


def test_schema_types_follow_refs_nullables_and_fall_back_to_json_text():
    from vlbatch.jobs.export.types import JSON_TEXT, Misfit, schema_type

    s = {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": ["integer", "null"]}}}},
         "type": "object", "properties": {"p": {"$ref": "#/$defs/pt"}, "any": {"anyOf": [{"type": "string"}]},
                                          "n": {"enum": [1, 2]}, "free": {"type": "object"}}}
    t = schema_type(s)
    assert t.type == pa.struct([("any", JSON_TEXT.type), ("free", JSON_TEXT.type), ("n", pa.int64()),
                                ("p", pa.struct([("x", pa.float64()), ("y", pa.int64())]))])
    assert t.check({"p": {"x": 1, "y": 2.0}, "any": "a", "n": 2, "free": {"k": [1]}}) == {
        "p": {"x": 1.0, "y": 2}, "any": '"a"', "n": 2, "free": '{"k": [1]}'}
    for bad in ({"p": {"x": True}}, {"n": 3}, {"p": {"y": 1.5}}, [1]):
        with pytest.raises(Misfit):
            t.check(bad)


def test_an_ok_copy_wins_over_an_error_copy_of_the_same_prompt():
    rows = [_row("a.png", 2, "has_text", "error", err="EngineError"), _row("a.png", 2, "has_text", answer="yes",
                                                                           parsed='"yes"')]
    t = named(rows_to_table(rows), False, pa.schema([]))
    spec = make_spec(_config("o").task, {"has_text"}, pa.schema([]))
    (row,) = pivot(t, spec).to_pylist()
    assert (row["has_text"], row["has_text_status"]) == ("yes", "ok")
