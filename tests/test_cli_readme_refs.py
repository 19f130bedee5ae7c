"""Every README section the product names exists (issue 50): `vlbatch --help` pointed at a section
"Running jobs" the README never had. The names are collected, not listed by hand: the argparse help
of `vlbatch` and of every sub-command, and every string constant (docstrings included) of the
product's modules that mentions the README; each must be a `#` heading of README.md."""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from vlbatch.jobs.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("operators", "pipeline", "jobs", "models", "scripts/devtools")  # setup.py's package roots
# `README "X"`, `README section "X"`, `the README's "X" section`, `"X" in the README`
NAMED = [re.compile(r"README(?:'s)?(?: section)?\s+\"([^\"]+)\""), re.compile(r"\"([^\"]+)\"\s+(?:section\s+)?"
                                                                              r"(?:in|of) the README")]


def readme_headings() -> set[str]:
    text = (REPO / "README.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a `#` comment in a code block is no heading
    return {m.group(1).strip().lower() for m in re.finditer(r"^#+\s+(.+?)\s*#*\s*$", text, re.M)}


def named_sections(text: str) -> set[str]:
    text = " ".join(text.split())  # a name may be wrapped across lines
    return {m.group(1) for pattern in NAMED for m in pattern.finditer(text)}


def help_texts() -> dict[str, str]:
    """'vlbatch', 'vlbatch run', ... -> its --help text."""
    out = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        out[name] = parser.format_help()
        for action in parser._actions:  # argparse keeps sub-commands only here
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(p, f"{name} {sub}")

    walk(build_parser(), "vlbatch")
    return out


def product_strings() -> dict[str, str]:
    """'path:line' -> each string constant of the product's modules that mentions the README."""
    out = {}
    for root in PRODUCT:
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "README" in node.value:
                    out[f"{path.relative_to(REPO)}:{node.lineno}"] = node.value
    return out


@pytest.mark.slow
def test_every_readme_section_named_by_a_help_or_message_exists():
    headings = readme_headings()
    assert {"troubleshooting", "resume and exactly-once"} <= headings, headings
    helps = help_texts()
    assert {"vlbatch", "vlbatch run", "vlbatch validate", "vlbatch inspect", "vlbatch submit"} <= set(helps)
    texts = {**{f"`{k} --help`": v for k, v in helps.items()}, **product_strings()}
    named = {(where, name) for where, text in texts.items() for name in named_sections(text)}
    assert any(where == "`vlbatch --help`" for where, _ in named), "the exit codes' README section is not named"
    missing = sorted(f"{where}: README section {name!r}" for where, name in named if name.lower() not in headings)
    assert not missing, "\n".join(missing)


def test_the_collector_sees_the_forms_a_text_names_a_section_in():
    assert named_sections('see README "Two commands"; the README\'s "Output" section') == {"Two commands", "Output"}
    assert named_sections('(see the README section\n   "Bundled model")') == {"Bundled model"}
    assert named_sections('"Scheduling" in the README') == {"Scheduling"}
