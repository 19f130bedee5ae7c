"""Run the vlbatch DAG once with `dag.test()` under a throwaway Airflow home.

Usage (with the Airflow venv's python): ``run_dag_test.py LOGICAL_DATE CONF_JSON``.
Expects AIRFLOW_HOME (migrated DB) and AIRFLOW__CORE__DAGS_FOLDER (this folder,
reserialized) in the environment; prints ``DAG_RESULT {json}`` with the run's state and
each task's state and XCom result, and exits 0 when the run succeeded, 1 otherwise.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from vlbatch_dag import dag

    when = dt.datetime.fromisoformat(sys.argv[1])
    conf = json.loads(sys.argv[2])
    run = dag.test(logical_date=when, run_conf=conf)
    tis = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
    result = {"state": str(run.state), "tasks": tis}
    print("DAG_RESULT " + json.dumps(result), flush=True)
    return 0 if str(run.state) == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
