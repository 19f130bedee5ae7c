"""The engineers' docs stay short and true: ARCHITECTURE.md's size, line length and the repository paths it
names; benchmarks/RESULTS.md opening with today's figures (one table) and linking its history."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HISTORY = ROOT / "benchmarks" / "RESULTS_HISTORY.md"

MAX_BYTES = 26_000
MAX_LINE = 120
# a backticked word naming a path in the repository starts with one of its top-level folders
TOP_FOLDERS = ("operators", "pipeline", "jobs", "models", "scripts", "infra", "benchmarks", "tests", "configs", "docs")
_PATH = re.compile(r"^(?:{})/[\w./-]*$".format("|".join(TOP_FOLDERS)))


def repo_paths(text: str) -> list[str]:
    """The repository paths named in backticks: `pipeline/stages/write_stage.py:check_output` names
    pipeline/stages/write_stage.py; placeholders (`operators/kernels/<point>/`) and globs are not paths."""
    paths = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for word in span.split():
            word = word.split(":", 1)[0].rstrip(".,;)")
            if _PATH.match(word):
                paths.append(word)
    return paths


def test_repo_paths_finds_paths_and_skips_the_rest():
    text = ("`pipeline/stages/write_stage.py:check_output`, `python -m x --config configs/demo.yaml`, "
            "`operators/kernels/<point>/`, `kernels/attention/`, `vlbatch.operators.sink`")
    assert repo_paths(text) == ["pipeline/stages/write_stage.py", "configs/demo.yaml"]


def test_architecture_is_short_with_short_lines():
    data = ARCHITECTURE.read_bytes()
    assert len(data) <= MAX_BYTES, f"ARCHITECTURE.md is {len(data)} bytes (at most {MAX_BYTES})"
    long = [(n, len(line)) for n, line in enumerate(data.decode().splitlines(), 1) if len(line) > MAX_LINE]
    assert long == [], f"ARCHITECTURE.md lines over {MAX_LINE} characters (line, length): {long}"


def test_architecture_names_only_paths_that_exist():
    paths = repo_paths(ARCHITECTURE.read_text())
    assert len(paths) > 20  # the layout names the modules
    missing = sorted({p for p in paths if not (ROOT / p).exists()})
    assert missing == [], f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_results_opens_with_todays_table_and_links_the_history():
    lines = RESULTS.read_text().splitlines()
    first_table = next(n for n, line in enumerate(lines) if line.startswith("|"))
    sections = [n for n, line in enumerate(lines) if line.startswith("#")]
    assert sections and sections[0] < first_table, "RESULTS.md starts with its title"
    assert all(n > first_table for n in sections[1:]), "the figures' table comes before any other section"
    assert HISTORY.exists() and "RESULTS_HISTORY.md" in RESULTS.read_text()
    assert len(RESULTS.read_bytes()) <= 8_000, "RESULTS.md holds today's figures only; history goes to its own file"
