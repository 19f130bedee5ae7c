"""The suite's tiers (tests/conftest.py): a test not marked `ray` that starts Ray fails, in this process
(`ray.init` refused) or in a child (its session folder under the test's own RAY_TMPDIR); so `make test-fast`
(`-m "not ray and not slow"`) starts no Ray. Each case runs the suite's own conftest in an inner pytest."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def _inner(pytester, body: str):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    ray: r\n    slow: s\n")
    pytester.makepyfile(test_inner=body)
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")


@pytest.mark.slow
def test_an_unmarked_test_starting_ray_in_process_fails_naming_the_marker(pytester):
    r = _inner(pytester, "def test_x():\n    import ray\n    ray.init(num_cpus=1)\n")
    r.assert_outcomes(failed=1)
    assert "test_inner.py::test_x starts Ray: mark it `pytest.mark.ray`" in r.stdout.str()


@pytest.mark.slow
def test_an_unmarked_test_whose_child_validates_plans_for_this_machine(pytester, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # a developer's shell: unmarked tests never see it
    r = _inner(pytester, "import os\ndef test_x():\n    assert 'RAY_ADDRESS' not in os.environ\n")
    r.assert_outcomes(passed=1)


@pytest.mark.slow
def test_an_unmarked_test_whose_child_starts_ray_fails_at_teardown(pytester):
    child = f"{sys.executable!r}, '-c', 'import ray; ray.init(num_cpus=1, include_dashboard=False); ray.shutdown()'"
    body = f"import subprocess\ndef test_x():\n    subprocess.run([{child}], check=True, capture_output=True)\n"
    r = _inner(pytester, body)
    r.assert_outcomes(passed=1, errors=1)  # the test's body passed; its teardown found the Ray session
    assert "test_inner.py::test_x started Ray (session_2" in r.stdout.str()
