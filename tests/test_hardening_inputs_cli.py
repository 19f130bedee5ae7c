"""Issue 31 acceptance, hidden-style: `vlbatch run` (the real CLI, a subprocess joining the session's Ray)
on a remote JSONL manifest (a loopback HTTP server) holding every bad input of the issue at once:
a JSON-array line, a line that is not UTF-8, a lone surrogate, blank questions, a relative path
climbing out of the host, media redirected to ftp:// and in a loop, 10,000 identical rows. It must
give one row per distinct request with typed errors, exit 0 (max_error_fraction 1), keep Ray's
noise off stdout and delete no file it did not write; `output.run_id: ..` is refused first."""
from __future__ import annotations

import json
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_jobs_support import read_output, vlbatch

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]

IDENTICAL = 10_000


class _Site(SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        target = {"/redir/ftp.png": "ftp://127.0.0.1/x.png", "/redir/loop.png": "/redir/loop.png",
                  "/redir/ok.png": "/ds/imgs/b.png"}.get(self.path)
        if target is None:
            return super().do_GET()
        self.send_response(302)
        self.send_header("Location", target)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def site(tmp_path):
    www = tmp_path / "www"
    (www / "ds" / "imgs").mkdir(parents=True)
    for i, name in enumerate(("a.png", "b.png")):
        img = (np.random.default_rng(i).random((40, 56, 3)) * 255).astype("uint8")
        Image.fromarray(img).save(www / "ds" / "imgs" / name)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Site, directory=str(www)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _manifest(www: Path, url: str) -> dict:
    """Writes ds/m.jsonl; returns {request id: (status, error_type)} expected, one per distinct request."""
    from vlbatch.pipeline.stages.requests import request_id

    m = f"{url}/ds/m.jsonl"
    img = f"{url}/ds/imgs"
    lines = [
        (b'["imgs/a.png", "Describe."]', [(f"{m}#L1", 0, "Describe.", "error", "InputError")]),
        (b'{"media_uri": "imgs/\xff.png"}', [(f"{m}#L2", 0, "Describe.", "error", "InputError")]),
        (b'{"media_uri": "imgs/a.png", "qs": ["\\ud800?"]}', [(f"{m}#L3", 0, "Describe.", "error", "InputError")]),
        (json.dumps({"media_uri": "imgs/b.png", "qs": ["What?", "", "  "]}).encode(),
         [(f"{img}/b.png", 0, "What?", "ok", None), (f"{img}/b.png", 1, "", "error", "InputError"),
          (f"{img}/b.png", 2, "  ", "error", "InputError")]),
        (b'{"media_uri": "../../../etc/passwd.png"}',
         [("../../../etc/passwd.png", 0, "Describe.", "error", "InputError")]),
        (b'{"media_uri": "/redir/ftp.png"}', [(f"{url}/redir/ftp.png", 0, "Describe.", "error", "MediaError")]),
        (b'{"media_uri": "/redir/loop.png"}', [(f"{url}/redir/loop.png", 0, "Describe.", "error", "MediaError")]),
        (b'{"media_uri": "/redir/ok.png"}', [(f"{url}/redir/ok.png", 0, "Describe.", "ok", None)]),
    ]
    body = b"\n".join(raw for raw, _ in lines) + b"\n" + b'{"media_uri": "imgs/a.png"}\n' * IDENTICAL
    (www / "ds" / "m.jsonl").write_bytes(body)
    expected = {request_id(key, i, p): (st, et) for _, reqs in lines for key, i, p, st, et in reqs}
    expected[request_id(f"{img}/a.png", 0, "Describe.")] = ("ok", None)
    return expected


def test_every_bad_input_at_once_through_the_cli(tmp_path, tiny_ckpt, site):
    www, url = site
    expected = _manifest(www, url)
    d = tmp_path / "d"
    foreign = [d / "_tmp" / "keep.txt", d / "out" / "_tmp" / "keep.txt", d / "out" / "hostile" / "_tmp" / "keep.txt",
               d / "out" / "hostile" / "_tmp" / "staged" / "x" / "notes.parquet"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("not vlbatch's")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {tiny_ckpt('dense')}, dtype: float32, device: cpu}}
input: {{uri: "{url}/ds/m.jsonl", format: jsonl, columns: {{questions: qs}}}}
task: {{mode: questions, questions: [Describe.]}}
sampling: {{max_tokens: 4}}
image: {{max_pixels: 12544}}
storage: {{retries: 1}}
resources:
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 4}}
  model: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 4}}
  write: {{num_cpus: 0.25, batch_size: 4}}
output: {{uri: {d / 'out'}, run_id: hostile}}
max_error_fraction: 1.0
""")
    refused = vlbatch("run", "--no-lock", str(cfg), "--set", "output.run_id=..", timeout=120)
    assert refused.returncode == 2 and "output.run_id" in refused.stderr, refused.stdout + refused.stderr
    r = vlbatch("run", "--no-lock", str(cfg), timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(raylet)" not in r.stdout and "\x1b[" not in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    rows = read_output(d / "out" / "hostile")
    ids = [x["id"] for x in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    assert sorted(ids) == sorted(expected)  # one row per distinct request
    for x in rows:
        assert (x["status"], x["error_type"]) == expected[x["id"]], (x["media_uri"], x["error_message"])
        assert x["error_message"] is None or "\n" not in x["error_message"]
    summary = json.loads((d / "out" / "hostile" / "_summary.json").read_text())
    assert summary["duplicate_ids"] == 0 and summary["committed_total"] == len(expected)
    assert all(f.read_text() == "not vlbatch's" for f in foreign)


def test_identical_rows_in_many_blocks_give_one_row_per_id(tmp_path, tiny_ckpt):
    """10,000 identical manifest rows in four files (four read tasks, so four blocks whose expansion
    each keeps its own copy): every copy that reaches the writers is committed, and `seal` keeps one."""
    media = tmp_path / "media"
    media.mkdir()
    Image.fromarray((np.random.default_rng(0).random((40, 56, 3)) * 255).astype("uint8")).save(media / "a.png")
    folder = tmp_path / "manifest"
    folder.mkdir()
    for k in range(4):
        (folder / f"part-{k}.jsonl").write_text((json.dumps({"media_uri": str(media / "a.png")}) + "\n")
                                                * (IDENTICAL // 4))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {tiny_ckpt('dense')}, dtype: float32, device: cpu}}
input: {{uri: {folder}, format: jsonl}}
task: {{prompt: Describe.}}
sampling: {{max_tokens: 4}}
image: {{max_pixels: 12544}}
resources:
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  model: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  write: {{num_cpus: 0.25, batch_size: 1}}
output: {{uri: {tmp_path / 'out'}, run_id: same}}
""")
    r = vlbatch("run", "--no-lock", str(cfg), timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "same" / "_summary.json").read_text())
    assert summary["processed_by_status"]["ok"] >= 2  # copies from several blocks reached the writers
    assert summary["duplicates_dropped"] + summary["processed_by_status"]["ok"] == IDENTICAL
    rows = read_output(tmp_path / "out" / "same")
    assert len(rows) == 1 and summary["duplicate_ids"] == 0 and summary["committed_total"] == 1
