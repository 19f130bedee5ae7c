# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both install the project first (idempotent: a stamp file records the install).
PY ?= python3

.PHONY: install demo test test-fast lint

.deps: pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	touch .deps

install: .deps

demo: .deps
	$(PY) -m vlbatch.jobs.cli demo

# Airflow (for tests/test_infra_airflow.py) in its own venv: its dependencies never touch ours; it
# sees $(PY)'s packages (this project, ray) through a .pth link (infra/airflow/link_sites.py).
.venv-airflow/.ok: .deps infra/airflow/setup-venv.sh infra/airflow/link_sites.py
	PY=$(PY) infra/airflow/setup-venv.sh .venv-airflow
	touch $@

# PYTHONFAULTHANDLER: a crash after the last test (interpreter exit; seen once, 2026-12-01, after 887
# passed) prints every thread's Python stack instead of a bare "Segmentation fault"
test: .deps .venv-airflow/.ok
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q --durations=25

# The inner loop: no Ray, no `vlbatch run` child, nothing marked slow (tests/conftest.py's markers; a test
# that starts Ray unmarked fails here and in `make test`)
test-fast: .deps
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -m "not ray and not slow" --durations=10

lint: .deps
	$(PY) -m ruff check .
