# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both install the project first (idempotent: a stamp file records the install).
PY ?= python3

.PHONY: install demo test lint

.deps: pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	touch .deps

install: .deps

demo: .deps
	$(PY) -m jobs.cli demo

test: .deps
	$(PY) -m pytest -q

lint: .deps
	$(PY) -m ruff check .
