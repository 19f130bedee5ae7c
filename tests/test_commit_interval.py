"""Issue 60 item 10: rows are published every `output.commit_interval_s` while the model is still at work,
on a loaded machine.

The write actor publishes its held rows from a timer thread of its own (`rolling.PublishTimer`), so a
writer that gets no next call still publishes when its oldest row is `commit_interval_s` old; and it
takes each model block as it comes (`resources.write.batch_size` None), so Ray Data does not hold rows
upstream of it until a count is reached.

The end-to-end test is a real `vlbatch run` (tiny checkpoint, joining the session's Ray) under CPU load the test
starts (busy processes, one per core). The run is certainly not finished while the test looks: its last
image is held by a loopback HTTP server until the test lets it go (`held_http`), so the final row is not
generated yet. The gate is the run's progress line saying the model generated rows; from then a part
file must appear within `commit_interval_s` plus a generous `MARGIN_S` (a loaded 2-core machine: the
rows still have to reach the writer), while the run is still running and the held row is in no part.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
from held_http import held_manifest
from test_jobs_support import REPO, TEST_ENV
from test_metrics_busy import Lines

from vlbatch.operators.sink import rolling
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.operators.sink.schema import OutputRow, Timings, rows_to_table

N_FREE = 6  # images served at once; the held one comes after them
INTERVAL_S = 2.0  # output.commit_interval_s of the run
MARGIN_S = 90.0  # on top of the interval: rows reach the writer and a parquet file is written on a loaded machine
GENERATED = re.compile(r"generated (\d+)  committed (\d+)/")


def _row(i: int) -> OutputRow:
    return OutputRow(id=f"id{i:03d}", request_index=0, media_uri=f"m{i}.jpg", media_type="image", prompt="p",
                     status="ok", model="tiny", run_id="r", answer="a", error_type=None, error_message=None,
                     prompt_tokens=1, visual_tokens=1, generated_tokens=1, finish_reason="stop",
                     timings=Timings(0.1, 0.1, 0.1))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_timer_publishes_a_held_batch_when_no_next_call_comes(tmp_path):
    """A writer holds one batch and gets no other: once the batch is `interval_s` old (the roller's clock,
    moved by the test) the timer publishes it, with no call."""
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    clock = Clock()
    roller = rolling.PartRoller(sink, rolling.RollPolicy(target_bytes=None, interval_s=5.0), group="w-1", clock=clock)
    timer = rolling.PublishTimer(roller, poll_s=0.05)
    try:
        assert roller.add(rows_to_table([_row(0), _row(1)])) == []
        assert roller.publish_due() == [] and sink.parts() == []  # not due yet
        clock.now = 5.0
        while not sink.parts():  # the gate: the timer's publish (bounded by the test timeout)
            time.sleep(0.05)
        timer.check()
        assert roller.held_rows == 0 and roller.due_in() is None
        assert sorted(sink.read().column("id").to_pylist()) == ["id000", "id001"]
        assert not list((tmp_path / "run" / "_tmp" / "staged" / "w-1").glob("*.parquet"))  # unstaged
    finally:
        timer.close()


def test_a_failed_timer_publish_is_raised_in_the_next_call(tmp_path):
    sink = ParquetSink(str(tmp_path / "run"))
    sink.prepare()
    clock = Clock()
    roller = rolling.PartRoller(sink, rolling.RollPolicy(target_bytes=None, interval_s=1.0), group="w-1", clock=clock)
    failed = threading.Event()

    def broken(table):
        failed.set()
        raise OSError("disk gone")

    timer = rolling.PublishTimer(roller, poll_s=0.05)
    try:
        roller.add(rows_to_table([_row(0)]))
        sink.commit = broken
        clock.now = 1.0
        failed.wait()
        while timer.error is None:
            time.sleep(0.05)
        with pytest.raises(OSError, match="disk gone"):
            timer.check()
        assert roller.held_rows == 1  # still held and staged: `seal` publishes it at the end
    finally:
        timer.close()


def _busy(n: int) -> list[subprocess.Popen]:
    """`n` processes spinning a core each: the loaded machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_a_part_is_published_within_the_interval_while_the_model_is_still_at_work(tmp_path, tiny_ckpt):
    manifest, server = held_manifest(tmp_path, N_FREE)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {tiny_ckpt('dense')}, dtype: float32, device: cpu}}
input: {{uri: {manifest}, format: jsonl}}
sampling: {{max_tokens: 8}}
image: {{max_pixels: 12544}}
resources:
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  model: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}}
  write: {{num_cpus: 0.25, min_actors: 1, max_actors: 1}}
output: {{uri: {tmp_path / 'out'}, commit_interval_s: {INTERVAL_S}}}
ray: {{progress_interval_s: 1}}
""")
    env = dict(os.environ, **TEST_ENV, HOME=str(tmp_path / "home"))  # RAY_ADDRESS kept: joins the session's Ray
    load = _busy(os.cpu_count() or 2)
    proc = subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--no-lock"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        err = Lines(proc.stderr)
        # the gate: the model has generated rows (the held image keeps the run from finishing)
        seen = err.wait_for(lambda line: (m := GENERATED.search(line)) is not None and int(m.group(1)) >= 1)
        assert seen is not None, "".join(err.lines[-30:])
        deadline = time.monotonic() + INTERVAL_S + MARGIN_S
        parts = []
        while not parts and time.monotonic() < deadline and proc.poll() is None:
            parts = list((tmp_path / "out").glob("*/part-*.parquet"))
            time.sleep(0.2)
        assert parts, f"no part within {INTERVAL_S} + {MARGIN_S} s of the first generated rows: " + \
            "".join(err.lines[-10:])
        assert proc.poll() is None and not server.release.is_set()  # the run still at work, the last row held
        published = [u for p in parts for u in pq.read_table(p, columns=["media_uri"])["media_uri"].to_pylist()]
        assert published and not any(u.endswith("/hold.png") for u in published)
        for p in load:
            p.kill()
        server.release.set()
        stdout, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout[-3000:] + "".join(err.lines[-40:])
    finally:
        for p in load:
            p.kill()
            p.wait()
        server.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rows = ParquetSink(str(next((tmp_path / "out").iterdir()))).read()
    assert rows.num_rows == N_FREE + 1 and len(set(rows.column("id").to_pylist())) == N_FREE + 1
