"""Issue 49's last acceptance item: the start-up walk (`scripts/walk_calls.py`, its docstring defines it).

`vlbatch run`'s start-up up to the Ray graph's execution returns to a module already left at most 8 times (64
on the main this test was written against) and enters `sink` (`plan/sink.py`), `fingerprint` and `preflight` once each
(2, 2 and 5 there); `vlbatch validate`'s walk too. The walk runs in its own interpreter, as the script is meant
to be run: what a process has imported or cached already changes which calls happen. Real parts: the demo
config and its media, a local Ray started and shut down by the script (the graph's run is where it stops).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WATCHED = ("sink", "fingerprint", "preflight")


def _figures(out: str) -> dict[str, dict[str, int]]:
    """{path: {figure: n}} of the script's lines ``validate: rooms 17, moves 22, returns 5, ...``."""
    found = {}
    for line in out.splitlines():
        if m := re.match(r"^(validate|run \(up to the graph\)): (.*)$", line):
            found[m.group(1)] = {k: int(v) for k, v in re.findall(r"([a-z_ ]+?) (\d+)(?:, |$)", m.group(2))}
    return found


@pytest.mark.slow
@pytest.mark.ray  # the script starts a local Ray of its own: the walk a user's `vlbatch run` takes (no RAY_ADDRESS)
def test_the_start_up_walk_returns_at_most_8_times_and_enters_each_check_module_once():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "scripts/walk_calls.py", "configs/demo.yaml"], cwd=REPO, text=True,
                       capture_output=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    walks = _figures(r.stdout)
    assert set(walks) == {"validate", "run (up to the graph)"}, r.stdout
    run, validate = walks["run (up to the graph)"], walks["validate"]
    assert run["returns"] <= 8, r.stdout
    assert validate["returns"] <= 8, r.stdout
    assert [run[f"{w} entered"] for w in WATCHED] == [1, 1, 1], r.stdout
    assert [validate[f"{w} entered"] for w in WATCHED] == [0, 1, 1], r.stdout  # validate opens no sink
