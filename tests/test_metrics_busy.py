"""Issue 53: a run seen from outside (Ray's Prometheus endpoint) and how busy its model was, and why.

One real `vlbatch run` on the tiny model, joined to the session's Ray (tests/conftest.py `ray_cluster`: its
node's metrics agent and endpoint; the endpoint holds every run of the session, so the test reads only its
run's series, a `job` tag of its own: `unique_job`), serves every check of the held case: its last
image is held by a loopback HTTP server (`HoldingServer`) so the CPU stage holds and the model waits, on
an event the test controls. While held, the test reads the run's progress lines until they say the model
waited (no timing: the line is the gate) and scrapes the node's endpoint; then it lets the image go and
checks the summary, the final line and the endpoint again. The reverse case (a model slow on purpose)
uses the model stage's test hook `VLBATCH_TEST_STEP_DELAY_S` (every engine step sleeps first): the only
stand-in here, as a model slower than its CPU stage cannot be had from the tiny checkpoint on 2 cores.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
import uuid

import pytest
from held_http import held_manifest
from test_jobs_support import REPO, TEST_ENV, write_job

from vlbatch.pipeline.telemetry.metrics import SERIES

pytestmark = pytest.mark.ray  # `vlbatch run` on the session's Ray (tests/conftest.py)
JOB = "metricsjob"
BUSY_LINE = re.compile(r"model busy (\d+)%: waiting on the CPU stage")


def unique_job(what: str) -> str:
    """A job name (the `job` tag of a run's series) no other run of the session has."""
    return f"{JOB}-{what}-{uuid.uuid4().hex[:8]}"


def _config(tmp_path, model_dir, manifest, job: str) -> str:
    cfg = tmp_path / f"{job}.yaml"
    cfg.write_text(f"""model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{uri: {manifest}, format: jsonl}}
sampling: {{max_tokens: 4}}
image: {{max_pixels: 12544}}
resources:
  decode: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  model: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  write: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
output: {{uri: {tmp_path / 'out'}}}
ray: {{progress_interval_s: 1}}
""")
    return str(cfg)


def scrape(port: int, job: str) -> dict:
    """{(series name, sorted labels): value} of vlbatch's series on the node's endpoint, `job`'s only."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_vlbatch_") and s.labels.get("job") == job:
                keep = tuple(sorted((k, v) for k, v in s.labels.items() if k in ("run_id", "stage", "kind", "flag",
                                                                                   "error_type", "result", "le")))
                out[(s.name, keep)] = out.get((s.name, keep), 0.0) + s.value  # summed over workers
    return out


def value(series: dict, name: str, **labels) -> float:
    return sum(v for (n, keep), v in series.items() if n == name and all((k, x) in keep for k, x in labels.items()))


class Lines:
    """A child's stderr, read on a thread; `wait_for(pattern)` blocks until a line matches (or it ends)."""

    def __init__(self, stream):
        self.lines, self.cond = [], threading.Condition()
        self.done = False
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def wait_for(self, match) -> str | None:
        seen = 0
        with self.cond:
            while True:
                for line in self.lines[seen:]:
                    if match(line):
                        return line
                seen = len(self.lines)
                if self.done:
                    return None
                self.cond.wait()


def _scrape_until(port: int, job: str, ok) -> dict:
    """Scrape until `ok(series)` (the agent exports every few seconds): bounded by the test's timeout."""
    while True:
        series = scrape(port, job)
        if ok(series):
            return series
        threading.Event().wait(1.0)


@pytest.mark.timeout(900)
def test_metrics_on_the_node_endpoint_and_the_starved_model_names_the_cpu_pool(tmp_path, tiny_ckpt, ray_cluster):
    manifest, server = held_manifest(tmp_path, 3)
    bad = tmp_path / "media" / "img01.png"
    bad.write_bytes(b"not a png at all")  # one error row: the errors counter by type
    port, job = ray_cluster.metrics_port, unique_job("busy")
    proc = None
    try:
        env = dict(os.environ, **TEST_ENV, HOME=str(tmp_path / "home"))
        proc = subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.cli", "run", _config(tmp_path, tiny_ckpt(),
                                 manifest, job), "--no-lock", "--address", ray_cluster.address],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                                start_new_session=True)
        err = Lines(proc.stderr)
        # the gate: the model has waited on the held CPU stage for most of its window
        held = err.wait_for(lambda line: (m := BUSY_LINE.search(line)) is not None and int(m.group(1)) <= 15)
        assert held is not None, "".join(err.lines[-30:])
        during = _scrape_until(port, job, lambda s: value(s, "ray_vlbatch_rows_total", stage="generated") >= 1
                               and any(n == "ray_vlbatch_model_busy_fraction" for n, _ in s))
        server.release.set()
        stdout, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout[-3000:] + "".join(err.lines[-40:])
        summary = json.loads(next((tmp_path / "out").glob("*/_summary.json")).read_text())
        run_id = summary["run_id"]
        committed = sum(summary["processed_by_status"].values())
        after = _scrape_until(port, job, lambda s: value(s, "ray_vlbatch_rows_total", stage="committed") >= committed
                              and value(s, "ray_vlbatch_tokens_total", kind="generated")
                              >= summary["generated_tokens"]
                              and all(value(s, "ray_vlbatch_quality_flags_total", flag=f) >= n
                                      for f, n in summary["quality_flags"].items()))
    finally:
        server.close()
        if proc is not None and proc.poll() is None:
            proc.kill()

    # the series exist with the job's tags; every series the dashboard may query was seen
    assert {n for n, _ in after} >= set(SERIES), sorted({n for n, _ in after})
    assert all(dict(keep)["run_id"] == run_id for _, keep in after)
    # counters only grow: each counter series seen while held is as high or higher after
    for key, v in during.items():
        if key[0].endswith("_total"):
            assert after.get(key, 0.0) >= v, key
    # the final values are the summary's
    assert value(after, "ray_vlbatch_rows_total", stage="committed") == committed == 4
    for stage in ("decoded", "preprocessed"):
        assert value(after, "ray_vlbatch_rows_total", stage=stage) == committed
    assert value(after, "ray_vlbatch_rows_total", stage="generated") == summary["processed_by_status"]["ok"] == 3
    for error_type, n in summary["error_types"].items():
        assert value(after, "ray_vlbatch_errors_total", error_type=error_type) == n
    assert sum(summary["error_types"].values()) == 1
    for kind in ("prompt", "visual", "generated", "cached"):
        assert value(after, "ray_vlbatch_tokens_total", kind=kind) == summary[f"{kind}_tokens"], kind
    assert value(after, "ray_vlbatch_model_call_seconds_count") >= 1
    # quality flags (max_tokens 4: the random model's answers stop at the limit: `truncated`)
    assert summary["quality_flags"].get("truncated", 0) >= 1, summary["quality_flags"]
    for flag, n in summary["quality_flags"].items():
        assert value(after, "ray_vlbatch_quality_flags_total", flag=flag) == n, flag
    # the starved model: low busy share, the wait on the CPU stage, the final line names the CPU pool
    occ = summary["occupancy"]
    assert occ["busy"] < 0.5 and occ["waiting_on_cpu"] > 0.3, occ
    (actor,) = summary["model_actors"]
    assert actor["rows"] == 3 and actor["rows_per_s_busy"] > actor["run_rows_per_s"]  # speed of light vs the run
    last = [line for line in stdout.splitlines() if line.startswith("[vlbatch] done:")][-1]
    assert "the model waited on the CPU stage" in last and "grow the CPU pool" in last, last
    fields = summary["timeline"]["fields"]
    assert sum(b[fields.index("model_wait_ms")] for b in summary["timeline"]["buckets"]) > 0


@pytest.mark.timeout(900)
def test_a_slow_model_names_the_model_pool(tmp_path, tiny_ckpt):
    """The reverse: every engine step sleeps (the test hook, see the module docstring), the CPU stage has
    all rows ready long before the model takes them: the final line names the model pool."""
    from test_jobs_support import vlbatch

    cfg = write_job(tmp_path / "wd", tiny_ckpt(), n_images=8, max_tokens=6, extra="")
    # one model call at a time (a call takes one block of 2 media): the other rows wait for the model. A new
    # local Ray of the run's own (`local_ray`): the hook's variable reaches the model actor only through the
    # environment of the raylet that starts it (the session's Ray, started by pytest, has not got it)
    run = vlbatch("run", str(cfg), "--no-lock", "--set", "ray.metrics=false", "--set",
                  "resources.model.max_concurrent_batches=1",
                  env={"VLBATCH_TEST_STEP_DELAY_S": "0.3", "HOME": str(tmp_path / "home")}, timeout=600,
                  local_ray=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = [line for line in run.stdout.splitlines() if line.startswith("[vlbatch] done:")][-1]
    assert "the CPU stage waited on the model" in last and "grow the model pool" in last, last
    summary = json.loads(next((tmp_path / "output").glob("*/_summary.json")).read_text())
    assert summary["occupancy"]["busy"] >= 0.7 and summary["occupancy"]["backlog"] > 0.3, summary["occupancy"]
