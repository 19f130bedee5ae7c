"""Each real-dataset source end to end through `vlbatch run` (a subprocess joining the session's Ray; the S3
one starts a local Ray of its own, see `test_hf_parquet_captions_keep_and_model_on_s3`):
a WebDataset shard written by `webdataset` (questions, kept members, resume exactly once),
a Hugging Face `datasets` Parquet export (captions, kept columns, `model.path` on moto S3:
the preprocess and model actors share one download) and http(s) media from loopback (questions,
kept columns, resume exactly once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_jobs_support import REPO, TEST_ENV, read_output
from test_sources_datasets import _png, _Server, s3_ckpt, write_shard  # noqa: F401 - s3_ckpt: a fixture

pytestmark = [pytest.mark.slow, pytest.mark.ray]

RESOURCES = """resources:
  preprocess: {num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}
  model: {num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}
  write: {num_cpus: 0.25, batch_size: 4}
"""


def _job(tmp_path, model: str, input_: str, task: str, extra: str = "") -> str:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {model}, dtype: float32, device: cpu, cache_dir: {tmp_path / 'cache'}}}
input: {input_}
task: {task}
sampling: {{max_tokens: 3}}
image: {{max_pixels: 12544}}
{RESOURCES}output: {{uri: {tmp_path / 'out'}, run_id: r1}}
max_error_fraction: 1.0
{extra}""")
    return str(cfg)


def _run(cfg: str, home, *, local_ray: bool = False) -> subprocess.CompletedProcess:
    """`vlbatch run CFG`: joining the session's Ray (RAY_ADDRESS), or with `local_ray` a new local Ray of its own."""
    env = dict(os.environ, **TEST_ENV, HOME=str(home))
    if local_ray:
        for k in ("RAY_AUTH_MODE", "RAY_ADDRESS"):
            env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "run", cfg, "--no-lock"], capture_output=True,
                       text=True, timeout=400, env=env, cwd=REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


def test_webdataset_questions_keep_and_resume(tmp_path, tiny_ckpt):
    write_shard(tmp_path / "train-000000.tar", 3)
    write_shard(tmp_path / "train-000001.tar", 2, first=3)
    cfg = _job(tmp_path, tiny_ckpt("dense"),
               f"{{uri: '{tmp_path}/train-{{000000..000001}}.tar', format: webdataset, columns: {{keep: [txt]}}}}",
               "{mode: questions, questions: ['What is it?', 'Which colour?']}")
    _run(cfg, tmp_path)
    rows = read_output(tmp_path / "out" / "r1")
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 2 * 5 and len(rows) == 2 * 5 + 2 * 2  # two samples without media: InputError rows
    assert {r["error_type"] for r in rows if r["status"] != "ok"} == {"InputError"}
    assert {r["media_uri"] for r in ok} == {f"{tmp_path}/train-00000{s}.tar#sample{i:04d}.png"
                                            for s, keys in ((0, range(3)), (1, range(3, 5))) for i in keys}
    assert all(r["txt"] == f"caption {int(r['media_uri'].rsplit('#sample', 1)[1][:4])}" for r in ok)
    again = _run(cfg, tmp_path)
    assert "0 ok, 0 error, 14 skipped" in again.stdout
    rows2 = read_output(tmp_path / "out" / "r1")
    assert sorted(r["id"] for r in rows2) == sorted(r["id"] for r in rows)  # exactly once


def test_hf_parquet_captions_keep_and_model_on_s3(tmp_path, s3_ckpt):  # noqa: F811 - the imported fixture
    """A local Ray of the run's own: its actors download the checkpoint from moto with the AWS credentials of
    the run's environment (`s3_ckpt` sets them in this process); the session's Ray workers have the
    environment its raylet started with, which may predate them."""
    import io

    from datasets import Dataset
    from datasets import Image as HFImage
    from PIL import Image

    pil = [Image.open(io.BytesIO(_png(i))) for i in range(3)]
    Dataset.from_dict({"image": pil, "label": [3, 1, 4]}).cast_column("image", HFImage()).to_parquet(
        str(tmp_path / "d.parquet"))
    cfg = _job(tmp_path, s3_ckpt["uri"], f"{{uri: {tmp_path / 'd.parquet'}, columns: {{media: image, keep: [label]}}}}",
               "{prompt: Describe.}", f"storage: {{endpoint_url: '{s3_ckpt['endpoint']}', region: us-east-1}}")
    _run(cfg, tmp_path, local_ray=True)
    rows = sorted(read_output(tmp_path / "out" / "r1"), key=lambda r: r["media_uri"])
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    assert [(r["media_uri"], r["label"]) for r in rows] == [(f"{tmp_path / 'd.parquet'}#{i}", v)
                                                             for i, v in enumerate([3, 1, 4])]
    assert rows[0]["model"] == s3_ckpt["uri"]
    folders = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(folders) == 1 and not list((tmp_path / "cache").glob("*.partial-*"))  # one download, two actors
    assert "0 ok, 0 error, 3 skipped" in _run(cfg, tmp_path, local_ray=True).stdout


def test_http_media_questions_keep_and_resume(tmp_path, tiny_ckpt):
    server = _Server()
    try:
        man = tmp_path / "m.jsonl"
        uris = [f"{server.url}/good.png", f"{server.url}/flaky.png", f"{server.url}/missing.png"]
        man.write_text("".join(json.dumps({"media_uri": u, "note": i}) + "\n" for i, u in enumerate(uris)))
        cfg = _job(tmp_path, tiny_ckpt("dense"), f"{{uri: {man}, format: jsonl, columns: {{keep: [note]}}}}",
                   "{mode: questions, questions: ['What is it?', 'Which colour?']}", "storage: {retries: 3}")
        _run(cfg, tmp_path)
        rows = read_output(tmp_path / "out" / "r1")
        assert len(rows) == 2 * 3 and len({r["id"] for r in rows}) == 6
        by = {(r["media_uri"], r["request_index"]): r for r in rows}
        assert [by[(u, k)]["status"] for u in uris for k in (0, 1)] == ["ok"] * 4 + ["error"] * 2
        assert by[(uris[2], 0)]["error_type"] == "MediaError"  # 404: permanent, kept on resume
        assert [by[(u, 0)]["note"] for u in uris] == [0, 1, 2]
        assert "nothing to do: all 6 requests of" in _run(cfg, tmp_path).stdout  # exactly once, no Ray started
        assert sorted(r["id"] for r in read_output(tmp_path / "out" / "r1")) == sorted(r["id"] for r in rows)
    finally:
        server.close()
