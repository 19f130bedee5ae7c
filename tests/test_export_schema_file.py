"""`vlbatch export` of a run whose questions use `schema_file` (issue 60, item 7): the run's `_fingerprint.json`
(written by the real `record_fingerprint`) records the schema inlined, not where it came from, so it reads back
as a task config and the media layout types its columns from it with no --config. A fingerprint written before
(schema and schema_file both recorded) reads the same: the export works and the run resumes unchanged.
The end-to-end form (a real `vlbatch run`) is tests/test_readme_read_recipes.py."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from test_export import A_TAGS, QUESTIONS, RUN_ID, TAGS, make_run

from vlbatch.jobs.cli import main
from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.plan.fingerprint import FINGERPRINT_NAME, check_fingerprint, record_fingerprint


def _job(out: Path, schema_file: Path) -> dict:
    """The job config as its user writes it: the tags question's schema in `schema_file`."""
    questions = [q if not (isinstance(q, dict) and q["name"] == "tags") else
                 {**q, "response_format": {"type": "json_schema", "schema_file": str(schema_file)}} for q in QUESTIONS]
    return {"model": {"path": "m"}, "input": {"uri": "in.jsonl", "columns": {"keep": ["label", "score"]}},
            "output": {"uri": str(out), "run_id": RUN_ID},
            "task": {"mode": "questions", "caption": True, "questions": questions}}


def _config(out: Path, schema_file: Path):
    return validate_config(_job(out, schema_file))


def _run(tmp_path) -> tuple[Path, object]:
    schema_file = tmp_path / "tags.json"
    schema_file.write_text(json.dumps(TAGS))
    out = tmp_path / "out"
    run = Path(make_run(str(out), fingerprint=False))
    cfg = _config(out, schema_file)
    record_fingerprint(cfg)
    return run, cfg


def _export_tags(capsys, run: Path, dest: Path) -> dict:
    code = main(["export", str(run), "-o", str(dest)])  # no --config: the fingerprint's task
    got = capsys.readouterr()
    assert code == 0, got.err
    assert got.out == f"exported 13 rows (5 media, 2 clips) to {dest}\n"
    rows = {r["media_uri"]: r for r in pq.read_table(dest).to_pylist() if r["clip_index"] is None}
    return rows


def test_a_schema_file_run_exports_with_no_config_typed_by_the_schema(tmp_path, capsys):
    run, _ = _run(tmp_path)
    recorded = json.loads((run / FINGERPRINT_NAME).read_text())["fingerprint"]
    tags = next(q for q in recorded["task.questions"] if isinstance(q, dict) and q["name"] == "tags")
    assert tags["response_format"] == {"type": "json_schema", "schema": TAGS}  # the schema, not where it was
    rows = _export_tags(capsys, run, tmp_path / "media.parquet")
    assert rows["a.png"]["tags"] == A_TAGS and rows["a.png"]["tags_status"] == "ok"
    assert rows["c.png"]["tags"] is None and rows["c.png"]["tags_status"] == "error"  # "many" is no integer
    assert rows["a.png"]["has_text"] == "yes"


def test_a_fingerprint_recorded_with_the_schema_file_beside_it_still_reads(tmp_path, capsys):
    run, cfg = _run(tmp_path)
    path = run / FINGERPRINT_NAME
    data = json.loads(path.read_text())
    for q in data["fingerprint"]["task.questions"]:  # as a run before this rule recorded it
        if isinstance(q, dict) and q["name"] == "tags":
            q["response_format"]["schema_file"] = str(tmp_path / "tags.json")
    path.write_text(json.dumps(data))
    rows = _export_tags(capsys, run, tmp_path / "media.parquet")
    assert rows["a.png"]["tags"] == A_TAGS
    note = check_fingerprint(cfg)  # the same config resumes that run: no change, nothing rewritten
    assert note.changes == {} and note.data is None
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(_job(tmp_path / "out", tmp_path / "tags.json")))  # JSON is YAML
    given = main(["export", str(run), "-o", str(tmp_path / "given.parquet"), "--config", str(job)])
    assert given == 0, capsys.readouterr().err  # the config agrees with the recorded task
