"""Issue 60 item 11: a run's last values reach Ray's metrics endpoint before its driver lets go of Ray, and
every series the Grafana board queries is among them (`ray_vlbatch_errors_total` of a run with error rows
included).

The run's counters live in its `Meter` actor, which dies with the driver; Ray exports what an actor
recorded only every `metrics_report_interval_ms`, so the driver waits for its final counts to be exported
before it ends (`telemetry/metrics.wait_exported`). The test runs a real job in this process (`run_job`,
the tiny model, one bad image) on the session's Ray (tests/conftest.py `ray_cluster`: its node's metrics
agent and endpoint), and scrapes the endpoint once, as `run_job` returns, which is when `vlbatch run`
shuts its local Ray down: no retry that could wait for a later export. The values must be the run's own
(its summary): the session's endpoint holds every run of the session, so only this run's series are read
(a `job` tag of its own).
"""
from __future__ import annotations

import io

import pytest
from test_jobs_support import write_job
from test_metrics_busy import scrape, unique_job, value

from vlbatch.pipeline.telemetry.metrics import SERIES


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_the_final_values_and_every_dashboard_series_are_on_the_endpoint_when_the_run_ends(tmp_path, tiny_ckpt,
                                                                                          ray_cluster):
    from vlbatch.pipeline.config import load_config
    from vlbatch.pipeline.graph import run_job

    job = unique_job("final")  # the `job` tag `scrape` keeps: this run's series only
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=4, name=f"{job}.yaml", write_batch=1)
    (tmp_path / "wd" / "media" / "img001.png").write_bytes(b"not a png at all")  # an error row
    summary = run_job(load_config(cfg), name=job, stream=io.StringIO())
    after = scrape(ray_cluster.metrics_port, job)  # once, as run_job returns: what a caller's ray.shutdown() would leave
    assert {n for n, _ in after} >= set(SERIES), sorted(set(SERIES) - {n for n, _ in after})
    assert {dict(keep)["run_id"] for _, keep in after} == {summary.run_id}  # the job's one run, as when it had its head
    assert summary.error_types == {"MediaError": 1}, summary.error_types
    assert value(after, "ray_vlbatch_errors_total", error_type="MediaError") == 1
    assert value(after, "ray_vlbatch_rows_total", stage="committed") == sum(summary.processed_by_status.values()) == 4
    for kind in ("prompt", "visual", "generated", "cached"):
        assert value(after, "ray_vlbatch_tokens_total", kind=kind) == getattr(summary, f"{kind}_tokens"), kind
