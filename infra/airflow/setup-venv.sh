#!/usr/bin/env bash
# Create the Airflow virtualenv used by tests/test_infra_airflow.py (and for local DAG runs).
# Airflow lives in its own venv so its ~90 dependencies never change the project's
# environment. It reuses $PY's installed ray[default], pydantic, pyyaml and vlbatch instead
# of downloading them again (~35 s): --system-site-packages gives it the base interpreter's
# packages, and link_sites.py adds $PY's own site-packages (needed when $PY is a venv's
# python, whose "system" is only its base interpreter). The link is refreshed on every call.
# Usage: [PY=python] infra/airflow/setup-venv.sh [VENV_DIR]   (default: .venv-airflow)
# LINK_ONLY=1: make the venv and the link, skip installing Airflow.
set -euo pipefail
VENV="${1:-.venv-airflow}"
PY="${PY:-python3}"
AIRFLOW_VERSION="${AIRFLOW_VERSION:-3.3.2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
"$PY" "$HERE/link_sites.py" "$VENV" >/dev/null
if [ "${LINK_ONLY:-0}" = 1 ] || "$VENV/bin/python" -c "import airflow" 2>/dev/null; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "apache-airflow==${AIRFLOW_VERSION}"
