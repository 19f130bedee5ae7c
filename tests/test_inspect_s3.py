"""`vlbatch inspect` on a run on S3 (moto in server mode on loopback, `s3_server` in conftest): the run
directory found under `output.uri`, the report, and thumbnails read from S3 (an object and a member
of a tar shard on S3); a missing object is a placeholder. Also RUN given as a job config."""
from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest
import yaml
from inspect_support import RUN_ID, image_bytes, make_run, rows_for, write_media
from PIL import Image

from vlbatch.jobs.inspect.text import run_inspect
from vlbatch.operators.storage import StorageOptions


@pytest.fixture(scope="module")
def s3_run(s3_server, tmp_path_factory):
    """(bucket, server): media and a run's output under s3://<bucket>/."""
    local = tmp_path_factory.mktemp("inspect-s3") / "media"
    write_media(local)
    bucket = f"inspect-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="media/red.png", Body=image_bytes((220, 30, 30)))
    client.put_object(Bucket=bucket, Key="media/data-000.tar", Body=(local / "data-000.tar").read_bytes())
    media = f"s3://{bucket}/media"
    rows = [r for r in rows_for(media, "unused") if r.media_uri is None or r.media_uri.startswith(
        (f"{media}/red.png", f"{media}/data-000.tar", f"{media}/gone.png"))]
    make_run(f"s3://{bucket}/out/{RUN_ID}", rows, StorageOptions(endpoint_url=s3_server.endpoint_url))
    return bucket, s3_server


def _src(card: str) -> np.ndarray:
    src = re.search(r'src="data:image/jpeg;base64,([^"]+)"', card).group(1)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src))).convert("RGB"))


@pytest.mark.slow
def test_inspect_a_run_on_s3_with_thumbnails_from_s3(s3_run, tmp_path):
    bucket, server = s3_run
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env.update({k: v for k, v in server.env.items() if not k.startswith("AWS_ENDPOINT_URL")})  # the flag says where
    page = tmp_path / "s3.html"
    res = subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "inspect", f"s3://{bucket}/out",
                          "--endpoint-url", server.endpoint_url, "--sample", "10", "--html", str(page)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"run s3://{bucket}/out/{RUN_ID}: 5 rows in 2 Parquet files\n"), res.stdout[:300]
    assert "status: 3 ok, 2 error\n" in res.stdout
    for et in ("InputError", "StorageError"):
        assert re.search(rf"^  {et}\s+1  e\.g\. ", res.stdout, re.M), res.stdout
    html = page.read_text()
    cards = {re.search(r'<div class="uri">([^<]*)<', c).group(1): c
             for c in re.split(r'(?=<div class="card[ "])', html) if c.startswith('<div class="card')}
    assert len(cards) == 5
    red = _src(cards[f"s3://{bucket}/media/red.png"])
    assert red[5, 5, 0] > 180 and red[5, 5, 2] < 80  # read from S3 and shrunk
    member = _src(cards[f"s3://{bucket}/media/data-000.tar#s001.png"])
    assert member[5, 5, 0] > 120 and member[5, 5, 1] < 80  # the purple member of the shard on S3
    gone = cards[f"s3://{bucket}/media/gone.png"]
    assert 'class="placeholder"' in gone and "MediaError" in gone and "<img" not in gone


def test_run_given_as_a_job_config(s3_run, tmp_path):
    bucket, server = s3_run
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(tmp_path)}, "input": {"uri": f"s3://{bucket}/manifest.jsonl", "format": "jsonl"},
        "output": {"uri": f"s3://{bucket}/out", "run_id": RUN_ID},
        "storage": {"endpoint_url": server.endpoint_url}, "video": {"fps": 1.0}}))
    buf = io.StringIO()
    assert run_inspect(str(cfg), sample=0, out=buf) == 0
    assert buf.getvalue().startswith(f"run s3://{bucket}/out/{RUN_ID}: 5 rows in 2 Parquet files\n")
    assert "status: 3 ok, 2 error" in buf.getvalue()
