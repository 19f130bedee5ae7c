"""Airflow DAG `vlbatch_nightly`: one vlbatch job per schedule slot on a Ray cluster.

Settings come from the environment of the Airflow workers (or DAG-run conf overrides of
the params of the same names): VLBATCH_CONFIG (job config path, inside VLBATCH_WORKDIR),
VLBATCH_WORKDIR (folder packaged to the cluster), VLBATCH_ADDRESS (Ray Jobs API, e.g.
http://ray-head:8265), VLBATCH_JOB_NAME, VLBATCH_SCHEDULE (cron, default ``0 2 * * *``),
VLBATCH_AIRFLOW_RETRIES (default 2).

`max_active_runs=1` keeps two slots of the job from overlapping; within a slot the
deterministic submission id keeps retries from starting a second copy (see
`vlbatch_operator`). Airflow 3 and 2.10+ are supported.
"""
from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path

from airflow import DAG

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the operator module beside this file
from vlbatch_operator import VlbatchJobOperator  # noqa: E402

with DAG(
    dag_id="vlbatch_nightly",
    schedule=os.environ.get("VLBATCH_SCHEDULE", "0 2 * * *"),
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "config": os.environ.get("VLBATCH_CONFIG", "configs/demo.yaml"),
        "workdir": os.environ.get("VLBATCH_WORKDIR", "."),
        "address": os.environ.get("VLBATCH_ADDRESS", "http://127.0.0.1:8265"),
        "job_name": os.environ.get("VLBATCH_JOB_NAME", "nightly"),
    },
    tags=["vlbatch"],
) as dag:
    VlbatchJobOperator(
        task_id="run_vlbatch",
        config="{{ params.config }}",
        workdir="{{ params.workdir }}",
        address="{{ params.address }}",
        job_name="{{ params.job_name }}",
        retries=int(os.environ.get("VLBATCH_AIRFLOW_RETRIES", "2")),
        retry_delay=dt.timedelta(minutes=5),
    )
