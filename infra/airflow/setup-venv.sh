#!/usr/bin/env bash
# Create the Airflow virtualenv used by tests/test_infra_airflow.py (and for local DAG runs).
# Airflow lives in its own venv so its ~90 dependencies never change the project's
# environment; --system-site-packages lets it reuse the installed ray[default], pydantic,
# pyyaml and the editable vlbatch install instead of downloading them again (~35 s).
# Usage: infra/airflow/setup-venv.sh [VENV_DIR]   (default: .venv-airflow)
set -euo pipefail
VENV="${1:-.venv-airflow}"
PY="${PY:-python3}"
AIRFLOW_VERSION="${AIRFLOW_VERSION:-3.3.2}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import airflow" 2>/dev/null; then
  exit 0
fi
"$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "apache-airflow==${AIRFLOW_VERSION}"
