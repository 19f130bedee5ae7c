"""A signal at any moment of `vlbatch run` (issue 50): SIGINT (Ctrl-C: the terminal's process group) and
SIGTERM (a scheduler: the main process) end the run with exit 130 / 143 and the one line
"[vlbatch] interrupted: N rows committed in <dir>/; rerun the same command to resume", no traceback,
whatever the run was doing: its start-up checks (after the plan line), Ray starting, the actors starting
and the model loading, and the last rows being published. What was committed stays exact: N is what
the run directory holds, each id once, and the rerun after the last phase has nothing left to do.
(Mid-run, with the resume computing the rest: tests/test_run_stops.py.)

Each phase is an event the test sees, never a timing: the run's own lines (the plan line, "starting
Ray", "starting the actors and loading the model"), and for the last rows a sink that holds: the
output is a Parquet sink added by a test plugin (the entry point group `vlbatch.sinks`, as any plugin
adds one; the folder is put on PYTHONPATH as pip would install it) whose first `seal` (the driver's
publishing of what the writers still held, after the graph) marks a file and waits until the test
releases it. This holding sink exists only in this test."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_jobs_support import REPO, TEST_ENV, read_output, write_job

N_IMAGES = 5
LINE = re.compile(r"\[vlbatch\] interrupted: (\d+) rows committed in (\S+)/; rerun the same command to resume")

PLUGIN = '''
import time
from pathlib import Path

from vlbatch.operators.sink.parquet import ParquetSink

GATE = Path({gate!r})


class HeldSink(ParquetSink):
    """Parquet; once GATE/armed exists, its first `seal` marks GATE/held and waits for GATE/release."""

    def seal(self, *args, **kwargs):
        if (GATE / "armed").exists() and not (GATE / "held").exists():
            (GATE / "held").touch()
            while not (GATE / "release").exists():
                time.sleep(0.05)
        return super().seal(*args, **kwargs)
'''


@pytest.fixture()
def held_sink_job(tmp_path, tiny_ckpt):
    """(config, gate folder, env with the plugin on the path)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    site = tmp_path / "site"
    info = site / "vlbatch_held_sink-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlbatch-held-sink\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[vlbatch.sinks]\nheld = held_sink:HeldSink\n")
    (site / "held_sink.py").write_text(textwrap.dedent(PLUGIN.format(gate=str(gate))))
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=N_IMAGES, write_batch=2, output=tmp_path / "out")
    cfg.write_text(cfg.read_text().replace("output: {uri: ", "output: {format: held, uri: "))
    env = dict(os.environ, **TEST_ENV, HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    # a new local Ray of the run's own, never the session's: its workers inherit this env (the plugin on the
    # path: the writers build the held sink too), and Ray starting is one of the phases signalled
    env.pop("RAY_ADDRESS", None)
    return cfg, gate, env


class Run:
    """`vlbatch run` as a subprocess in its own process group, its stdout and stderr lines read as they come."""

    def __init__(self, cfg: Path, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "vlbatch.jobs.cli", "run", str(cfg), "--no-lock"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=REPO, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.readers = [threading.Thread(target=self._pump, args=(s, k), daemon=True)
                        for s, k in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"))]
        for t in self.readers:
            t.start()

    def _pump(self, stream, key: str) -> None:
        for line in stream:
            self.out[key].append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str) -> None:
        """Until a line of the run matches `pattern` (an event of the run; its end first is a failure)."""
        ended = 0
        while ended < 2:
            line = self.lines.get(timeout=600)
            if line is None:
                ended += 1
            elif re.search(pattern, line):
                return
        self.proc.wait(60)
        raise AssertionError(f"the run ended without a line matching {pattern!r}: {self.text()}")

    def send(self, signum: int) -> None:
        if signum == signal.SIGINT:
            os.killpg(self.proc.pid, signum)  # Ctrl-C at a terminal: the whole foreground process group
        else:
            os.kill(self.proc.pid, signum)  # a scheduler: the main process

    def finish(self) -> int:
        try:
            code = self.proc.wait(600)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for t in self.readers:
            t.join(60)
        return code

    def text(self) -> str:
        return "".join(self.out["stdout"]) + "\n--- stderr\n" + "".join(self.out["stderr"])


def _stopped(run: Run, code: int) -> list[dict]:
    """The run ended in the one line with `code`; -> the rows its directory holds (as many as the line says)."""
    assert run.finish() == code, run.text()
    assert "Traceback" not in run.text(), run.text()
    m = LINE.fullmatch(run.out["stdout"][-1].rstrip("\n"))
    assert m, run.text()
    run_dir = Path(m.group(2))
    rows = read_output(run_dir) if run_dir.is_dir() else []
    assert int(m.group(1)) == len(rows) == len({r["id"] for r in rows}), run.text()
    assert not (run_dir / "_tmp").exists()  # nothing half-written left beside the parts
    return rows


@pytest.mark.ray
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_any_phase_exits_with_its_code_and_the_one_line(held_sink_job, signum, code):
    cfg, gate, env = held_sink_job
    for phase in (r"^\[vlbatch\] plan: ", r"^\[vlbatch\] starting Ray$",
                  r"^\[vlbatch\] starting the actors and loading the model$"):
        run = Run(cfg, env)
        run.wait_for(phase)
        run.send(signum)
        _stopped(run, code)

    (gate / "armed").touch()  # the last rows: held while the driver publishes what the writers still held
    run = Run(cfg, env)
    run.wait_for(r"^\[vlbatch\] job ")
    while not (gate / "held").exists():  # the event: the seal holds the run (never released: the signal ends it)
        assert run.proc.poll() is None, run.text()
        time.sleep(0.1)
    run.send(signum)
    rows = _stopped(run, code)
    assert len(rows) == N_IMAGES and all(r["status"] == "ok" for r in rows)

    again = Run(cfg, env)  # everything committed: the rerun says so and starts nothing
    assert again.finish() == 0, again.text()
    assert "nothing to do" in again.out["stdout"][-1], again.text()
    assert len(read_output(Path(LINE.fullmatch(run.out["stdout"][-1].rstrip("\n")).group(2)))) == N_IMAGES


def test_a_signal_during_ray_shutdown_is_noted_not_lost():
    """The shutdown window (`jobs/local._shutdown_ray`): the block runs to its end, the signal is listed for
    the run to end by it after (on main: ignored, and a run stopped then exited 0). A real SIGTERM to this
    process, sent inside the block: the event is the test's own call."""
    from vlbatch.jobs.stops import signals_deferred

    before = signal.getsignal(signal.SIGTERM)
    with signals_deferred() as noted:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundaries of this thread
            if noted:
                break
    assert noted == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


def test_ray_inits_own_sigterm_exit_is_the_sigterm():
    """`ray.init` sets SIGTERM handlers of its own while it runs (`sys.exit(15)`, then `sys.exit(1)` once its
    node is up); a SIGTERM then was exit 15 or 1 with no line. Which of Ray's handlers a real signal meets
    cannot be arranged, so a stand-in for the `ray` module (its `init` raising what those handlers raise)
    stands for it here; the whole run with a real signal while Ray starts is the test above."""
    from vlbatch.jobs.connect import _init
    from vlbatch.jobs.stops import Interrupted, stop_signals

    class RayWhoseHandlerFired:
        def __init__(self, code):
            self.code = code

        def init(self, **kwargs):
            raise SystemExit(self.code)

    with stop_signals():
        for code in (15, 1):
            with pytest.raises(Interrupted) as stop:
                _init(RayWhoseHandlerFired(code), address=None)
            assert stop.value.exit_code == 143
