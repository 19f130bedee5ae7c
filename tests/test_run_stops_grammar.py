"""A SIGTERM while a run's model actor compiles a costly grammar (issue 60, item 16) ends the run as a stop
does: exit 143 and the one line "[vlbatch] interrupted: N rows committed in <dir>/; rerun the same command
to resume", never "vlbatch: the run failed: Interrupted: SIGTERM".

That line came from the run's failure path (`jobs/local._run`'s `except Exception`): an exception raised
while the SIGTERM's `Interrupted` unwound the run (a library's cleanup failing on the way) was described as
a failure whose innermost cause is the `Interrupted`. Such a run was stopped: it ends as a stop does
(`jobs/stops.interruption`).

- `test_a_sigterm_while_the_engine_compiles_a_grammar_is_a_stop`: a real `vlbatch run` on the tiny checkpoint
  whose caption format (a JSON schema of a 100,000-value enum) takes tens of seconds to compile; the event is
  a marker file the compile writes as it starts, in the process that compiles for the model actor (an
  observer on xgrammar's `compile_grammar`, installed by a `sitecustomize` on PYTHONPATH, which runs the real
  compile; the CLI's own compiles, validate's, are not marked). The compiling process is gone after the stop.
- `test_a_cleanup_that_fails_as_a_sigterm_unwinds_the_run_is_a_stop`: the failing cleanup itself, made
  certain: a sink added by a test plugin (as in tests/test_run_stops_phases.py) holds the run at its seal and,
  when the signal unwinds it, raises from its cleanup (a stand-in for Ray's: which of Ray's cleanups fails
  cannot be arranged). On main this printed "vlbatch: the run failed: Interrupted: SIGTERM" and exit 1.
"""
from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
from test_jobs_support import TEST_ENV, read_output, write_job
from test_run_stops_phases import LINE, Run

pytestmark = pytest.mark.ray

OBSERVER = '''
import importlib.abc
import importlib.machinery
import os
import sys

MARKS = os.environ.get("VLBATCH_TEST_COMPILE_MARKS")


class _Observed(importlib.abc.MetaPathFinder):
    """xgrammar as it is, its GrammarCompiler.compile_grammar marking MARKS/<pid>-<ppid> as it starts."""

    def find_spec(self, name, path, target=None):
        if name != "xgrammar":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real_loader = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real_loader.create_module(spec)

            def exec_module(self, module):
                real_loader.exec_module(module)
                real = module.GrammarCompiler.compile_grammar

                def compile_grammar(self, *args, **kwargs):
                    open(os.path.join(MARKS, f"{os.getpid()}-{os.getppid()}"), "w").close()
                    return real(self, *args, **kwargs)

                module.GrammarCompiler.compile_grammar = compile_grammar

        spec.loader = Loader()
        return spec


if MARKS:
    sys.meta_path.insert(0, _Observed())
'''

FAILING_CLEANUP = '''
import time
from pathlib import Path

from vlbatch.operators.sink.parquet import ParquetSink

GATE = Path({gate!r})


class CleanupFails(ParquetSink):
    """Parquet; its first `seal` marks GATE/held and waits; when a signal unwinds it, its cleanup fails."""

    def seal(self, *args, **kwargs):
        if not (GATE / "held").exists():
            (GATE / "held").touch()
            try:
                while True:
                    time.sleep(0.05)
            except BaseException:
                raise RuntimeError("the cleanup failed")  # raised while handling the signal's Interrupted
        return super().seal(*args, **kwargs)
'''


def _env(tmp_path: Path, site: Path, **extra: str) -> dict:
    env = dict(os.environ, **TEST_ENV, HOME=str(tmp_path / "home"), **extra,
               PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    # a new local Ray of the run's own, never the session's: its workers must inherit this env (the observer's
    # sitecustomize and marks folder in the model actor, the plugin sink in the writers)
    env.pop("RAY_ADDRESS", None)
    return env


def _stopped(run: Run) -> list[dict]:
    """Exit 143 and the one line, no traceback -> the rows the run directory holds (as many as the line says)."""
    assert run.finish() == 143, run.text()
    assert "Traceback" not in run.text() and "the run failed" not in run.text(), run.text()
    m = LINE.fullmatch(run.out["stdout"][-1].rstrip("\n"))
    assert m, run.text()
    run_dir = Path(m.group(2))
    rows = read_output(run_dir) if run_dir.is_dir() else []
    assert int(m.group(1)) == len(rows), run.text()
    return rows


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_sigterm_while_the_engine_compiles_a_grammar_is_a_stop(tmp_path, tiny_ckpt):
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(OBSERVER))
    wd = tmp_path / "wd"
    cfg = write_job(wd, tiny_ckpt("dense"), n_images=3, output=tmp_path / "out")
    (wd / "enum.json").write_text(json.dumps({"enum": [f"v{i:05d}" for i in range(100_000)]},
                                             separators=(",", ":")))  # 900 KB: within a schema file's 1 MiB
    text = cfg.read_text().replace("task: {prompt: Describe.}",
                                   "task: {prompt: Describe., response_format: {type: json_schema, "
                                   "schema_file: enum.json}}")
    # a budget it passes (validate compiles it too): the run's own compile is the one the signal meets
    cfg.write_text(text.replace("device: cpu}", "device: cpu, engine: {grammar: {compile_s: 3000, "
                                                "max_bytes: 4000000}}}"))
    run = Run(cfg, _env(tmp_path, site, VLBATCH_TEST_COMPILE_MARKS=str(marks)))
    run.wait_for(r"^\[vlbatch\] job ")
    cli = str(run.proc.pid)
    compiling = None
    while compiling is None:  # the event: a compile for the model actor began (not the CLI's, nor its child's)
        assert run.proc.poll() is None, run.text()
        compiling = next((m.name for m in marks.iterdir() if cli not in m.name.split("-")), None)
        time.sleep(0.1)
    run.send(signal.SIGTERM)
    assert _stopped(run) == []
    pid = int(compiling.split("-")[0])
    for _ in range(1200):  # the compiling process ends with the run (not a timing claim: a hang guard)
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), f"the process compiling the grammar ({pid}) outlived the run"


def test_a_cleanup_that_fails_as_a_sigterm_unwinds_the_run_is_a_stop(tmp_path, tiny_ckpt):
    gate, site = tmp_path / "gate", tmp_path / "site"
    gate.mkdir()
    info = site / "vlbatch_cleanup_fails-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlbatch-cleanup-fails\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[vlbatch.sinks]\ncleanup-fails = cleanup_fails:CleanupFails\n")
    (site / "cleanup_fails.py").write_text(textwrap.dedent(FAILING_CLEANUP.format(gate=str(gate))))
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2, output=tmp_path / "out")
    cfg.write_text(cfg.read_text().replace("output: {uri: ", "output: {format: cleanup-fails, uri: "))
    run = Run(cfg, _env(tmp_path, site))
    run.wait_for(r"^\[vlbatch\] job ")
    while not (gate / "held").exists():  # the event: the seal holds the run
        assert run.proc.poll() is None, run.text()
        time.sleep(0.1)
    run.send(signal.SIGTERM)
    rows = _stopped(run)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
