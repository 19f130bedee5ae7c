"""The engineers' docs stay short and true: ARCHITECTURE.md's size, line length and the repository paths it
names (its "To change X, touch Y" table's too, folder-relative ones included, and the registry files it names);
benchmarks/RESULTS.md opening with today's figures (one table) and linking its history."""
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


TOUCH = "## To change X, touch Y"
_FILE = re.compile(r"\.[a-z]+$")  # `config.py`, `__init__.py`: a file named by itself


def touch_rows() -> dict[str, str]:
    """{what to change: where to touch} of ARCHITECTURE.md's "To change X, touch Y" table (the section to the next
    heading: the table and the notes on its rows)."""
    section = ARCHITECTURE.read_text().split(TOUCH, 1)[1].split("\n## ", 1)[0]
    cells = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {change.strip(): touch.strip() for change, touch in cells[2:]}  # after the header and its rule


def _innermost(path: Path, pattern: str) -> list[Path]:
    for folder in (p for p in [path, *path.parents] if p.is_dir() and ROOT in p.parents):
        if found := list(folder.glob(pattern)):
            return found
    return []


def touched_paths(cell: str) -> list[tuple[str, list[Path]]]:
    """Every path a row's cell names in backticks, with what it matches in the tree: a path from a top-level
    folder as it is; a folder-relative one (`ops/warm_up.py`, `__init__.py`) under the innermost folder holding it
    of a path the cell named before it; a placeholder (`<point>`) matches any name."""
    named, anchors = [], []
    for span in re.findall(r"`([^`\n]+)`", cell):
        for word in span.split():
            word = word.rstrip(".,;)")
            if "/" not in word and not _FILE.search(word):
                continue  # a class or a name (`Entry`, `Sink`), not a path
            pattern = re.sub(r"<\w+>", "*", word).rstrip("/")
            if "/" in word and word.split("/", 1)[0] in TOP_FOLDERS:
                found = sorted(ROOT.glob(pattern))
            else:  # under the innermost folder, from each earlier path up, that holds it
                found = sorted({m for a in anchors for m in _innermost(a, pattern)})
            named.append((word, found))
            anchors += found
    return named


def test_touched_paths_resolves_folder_relative_names_and_placeholders():
    cell = "`operators/model/ops/` (`<op>_cpu.py` + twin), `ops/warm_up.py`, `nope/gone.py`, a `Sink` subclass"
    got = {word: [p.relative_to(ROOT).as_posix() for p in found] for word, found in touched_paths(cell)}
    assert got["operators/model/ops/"] == ["operators/model/ops"]
    assert "operators/model/ops/conv_cpu.py" in got["<op>_cpu.py"]
    assert got["ops/warm_up.py"] == ["operators/model/ops/warm_up.py"]
    assert got["nope/gone.py"] == [] and "Sink" not in got


def test_the_touch_table_names_only_paths_that_exist():
    rows = touch_rows()
    assert len(rows) > 10 and "a CLI command" in rows
    missing = [(change, word) for change, touch in rows.items() for word, found in touched_paths(touch) if not found]
    assert missing == [], f"ARCHITECTURE.md's {TOUCH!r} names paths that do not exist: {missing}"


def test_the_touch_table_names_each_registry_where_its_entries_are():
    """A row adding "one `Entry` in X" names the file holding that `Registry`; every job config choice (the
    extension points `pipeline/config/choices.py` lists) has such a row; and the section says that such an
    entry regenerates `configs/job.schema.json`."""
    from vlbatch.pipeline.config.choices import _points

    entry_files: set[Path] = set()
    for change, touch in touch_rows().items():
        for where in re.findall(r"one `Entry` in (`[^`]+`)", touch):
            found = dict(touched_paths(touch))[where.strip("`")]
            assert found and all(f.is_file() and "Registry(" in f.read_text() for f in found), (change, where, found)
            entry_files.update(found)
    points = {Path(module.__file__).resolve(): attr for module, attr in _points()}
    unnamed = sorted(f"{p.relative_to(ROOT)} ({attr})" for p, attr in points.items() if p not in entry_files)
    assert unnamed == [], f"registries of job config choices with no row in {TOUCH!r}: {unnamed}"
    section = ARCHITECTURE.read_text().split(TOUCH, 1)[1].split("\n## ", 1)[0]
    assert "python -m vlbatch.pipeline.config --schema" in section and "`configs/job.schema.json`" in section


def test_results_opens_with_todays_table_and_links_the_history():
    lines = RESULTS.read_text().splitlines()
    first_table = next(n for n, line in enumerate(lines) if line.startswith("|"))
    sections = [n for n, line in enumerate(lines) if line.startswith("#")]
    assert sections and sections[0] < first_table, "RESULTS.md starts with its title"
    assert all(n > first_table for n in sections[1:]), "the figures' table comes before any other section"
    assert HISTORY.exists() and "RESULTS_HISTORY.md" in RESULTS.read_text()
    assert len(RESULTS.read_bytes()) <= 8_000, "RESULTS.md holds today's figures only; history goes to its own file"
