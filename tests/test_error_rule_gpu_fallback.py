"""Issue 50: a count-aware error rule (`max_error_fraction` and `min_error_rows`), and the model
planned on the CPU said in one line, refused on a joined cluster that can never get a GPU."""
from __future__ import annotations

import json
import threading

import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.plan.cluster import Cluster


def _summary(errors: int, total: int, **kw):
    from vlbatch.pipeline.telemetry.summary import RunSummary

    status = {"ok": total - errors, "error": errors}
    return RunSummary(run_id="r", output_dir="/out/r", requests_pending=0, requests_skipped=0,
                      processed_by_status=dict(status), committed_by_status=dict(status), committed_total=total,
                      error_fraction=errors / total, max_error_fraction=0.05, **kw)


def test_one_bad_file_in_a_small_trial_does_not_fail_the_run():
    from vlbatch.jobs.local import summary_line

    s = _summary(1, 14, min_error_rows=10)  # 7 % > 5 %, but 1 error row < 10
    assert not s.exceeded_error_fraction and s.exit_code == 0
    line = summary_line(s)
    assert "all rows written" in line and "min_error_rows 10" in line and "failed" not in line
    assert json.loads(s.to_json())["exit_code"] == 0


def test_past_both_limits_the_run_fails_and_the_line_names_them():
    from vlbatch.jobs.local import summary_line

    s = _summary(12, 100, min_error_rows=10)  # 12 % > 5 % and 12 rows >= 10
    assert s.exceeded_error_fraction and s.exit_code == 1
    line = summary_line(s)
    assert "all rows written" in line and "max_error_fraction 5%" in line and "min_error_rows 10" in line
    assert line.endswith("failed")
    many_but_rare = _summary(20, 1000, min_error_rows=10)  # 20 rows but 2 %: under the share
    assert many_but_rare.exit_code == 0 and "exit 0 (a run fails only past both)" in summary_line(many_but_rare)
    assert "errors stayed under the limits" in summary_line(_summary(1, 100, min_error_rows=10))


def test_min_error_rows_is_a_config_field_next_to_max_error_fraction(tmp_path):
    from pathlib import Path

    base = {"model": {"path": "m"}, "input": {"uri": str(tmp_path / "*.png"), "format": "glob"},
            "output": {"uri": str(tmp_path / "out")}}
    assert validate_config(base).min_error_rows == 10
    assert validate_config({**base, "min_error_rows": 0}).min_error_rows == 0
    with pytest.raises(ConfigError, match="min_error_rows"):
        validate_config({**base, "min_error_rows": -1})
    schema = json.loads((Path(__file__).parents[1] / "configs" / "job.schema.json").read_text())
    assert schema["properties"]["min_error_rows"]["default"] == 10


def _gpu_cfg(tmp_path, device="auto"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "a.png").write_bytes(b"")
    return validate_config({"model": {"path": "m", "device": device},
                            "input": {"uri": str(tmp_path / "*.png"), "format": "glob"},
                            "resources": {"model": {"num_gpus": 1}}, "output": {"uri": str(tmp_path / "out")}})


def _cluster(fixed_size: bool, may_add_gpus, where="the Ray at 10.0.0.1:6379") -> Cluster:
    return Cluster(cpus=16.0, gpus=0.0, memory_bytes=64 << 30, fixed_size=fixed_size, where=where,
                   may_add_gpus=may_add_gpus)


def test_a_gpu_less_machine_says_the_model_runs_on_the_cpu(tmp_path):
    from vlbatch.pipeline.plan.fit import check_plan
    from vlbatch.pipeline.plan.spec import plan

    cfg = _gpu_cfg(tmp_path)
    here = _cluster(True, False, where="this machine")
    fitted, _ = check_plan(cfg, here)
    p = plan(fitted, here)
    assert p.reserves()[1] == 0
    assert p.device_line() == ("the model will run on the CPU: no GPU here (resources.model.num_gpus=1, "
                               "model.device=auto; set resources.model.num_gpus=0 to plan it there, or "
                               "model.device=cuda to require a GPU)")
    assert plan(_gpu_cfg(tmp_path / "c", device="cpu"), here).device_line() is None  # the CPU was asked for


def test_a_model_asking_no_gpu_says_it_runs_on_the_cpu(tmp_path):
    """Issue 60 item 13: `num_gpus: 0` (the default) with `device: auto` planned `+ 0 GPU` and said nothing."""
    from vlbatch.pipeline.plan.spec import plan

    here = _cluster(True, False, where="this machine")
    cfg = _gpu_cfg(tmp_path)
    cpu = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={
        "model": cfg.resources.model.model_copy(update={"num_gpus": 0.0})})})
    assert plan(cpu, here).device_line() == (
        "the model will run on the CPU: resources.model.num_gpus=0 (set it to 1 to give each model actor a GPU, "
        "or model.device=cpu to say the CPU is meant)")
    said = cpu.model_copy(update={"model": cpu.model.model_copy(update={"device": "cpu"})})
    assert plan(said, here).device_line() is None


def test_a_joined_cluster_that_can_never_get_a_gpu_is_refused(tmp_path):
    from vlbatch.pipeline.plan.fit import check_plan
    from vlbatch.pipeline.plan.spec import plan

    cfg = _gpu_cfg(tmp_path)
    with pytest.raises(ConfigError, match=r"resources\.model\.num_gpus: 1 .*no GPU node and no autoscaler"):
        check_plan(cfg, _cluster(False, False))
    grows = _cluster(False, True)  # an autoscaler whose node types include GPUs: the model waits for one
    fitted, _ = check_plan(cfg, grows)
    p = plan(fitted, grows)
    assert p.reserves()[1] == 1 and p.device_line() is None
    unknown = _cluster(False, None)  # an autoscaler whose node types Ray does not publish: as before, on the CPU
    fitted, _ = check_plan(cfg, unknown)
    assert plan(fitted, unknown).device_line().startswith("the model will run on the CPU: no GPU on the Ray at")


def test_gpu_growth_read_from_what_ray_publishes():
    from vlbatch.pipeline.plan.cluster import gpu_growth

    assert gpu_growth({"CPU": 8, "GPU": 4}, None) is True  # the cluster config's node types (autoscaler v2)
    assert gpu_growth({"CPU": 8, "GPU": 0}, b"{}") is False
    assert gpu_growth(None, b'{"autoscaler_report": {}}') is None  # an autoscaler (v1): node types unknown
    assert gpu_growth(None, b'{"load_metrics_report": {}}') is False  # a head's monitor without an autoscaler
    # a plain `ray start --head`: its monitor runs the read-only provider, each node typed `node_<id>` (Ray 2.60)
    plain = {"autoscaler_report": {"node_type_mapping": {"ab12": "node_ab12"}, "pending_launches": {}, "legacy": True}}
    assert gpu_growth(None, json.dumps(plain).encode()) is False
    typed = {"autoscaler_report": {"node_type_mapping": {"ab12": "gpu-workers"}, "pending_launches": {}}}
    assert gpu_growth(None, json.dumps(typed).encode()) is None  # node types of a cluster config: unknown
    assert gpu_growth(None, None) is False  # no status at all
    assert gpu_growth(None, b"not json") is None  # unreadable: unknown, never refused on a doubt


@pytest.mark.ray
def test_a_plain_joined_head_has_no_autoscaler_and_refuses_the_gpu(tmp_path, ray_jobs_head):
    """A real `ray start --head` without an autoscaling config (its monitor still writes a status):
    joined, it can never add a GPU node, so `device: auto` + `num_gpus: 1` is refused. The head is the
    session's `ray_jobs_head` (a plain `ray start --head`, shared with the Jobs API tests); joining it here
    leaves the session's Ray (conftest reconnects the next test marked `ray`)."""
    import ray
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    from vlbatch.pipeline.plan.cluster import joined_cluster
    from vlbatch.pipeline.plan.fit import check_plan

    head = ray_jobs_head
    ray.shutdown()  # this process was on the session's Ray
    try:
        ray.init(address=head.gcs_address)
        status = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        for _ in range(600):  # gate on the monitor's first status (written every few seconds)
            if status:
                break
            threading.Event().wait(0.5)
            status = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        assert status, "the head's monitor never wrote its status"
        cluster = joined_cluster("the Ray at the test head")
        assert cluster.gpus == 0 and cluster.may_add_gpus is False
        with pytest.raises(ConfigError, match=r"resources\.model\.num_gpus: 1 .*no GPU node and no autoscaler"):
            check_plan(_gpu_cfg(tmp_path), cluster)
    finally:
        ray.shutdown()  # only this driver's connection: the head is the session's


@pytest.mark.ray
def test_a_bad_file_in_a_small_cli_run_exits_0_and_says_so(tmp_path, tiny_ckpt):
    """One real run for both items: 1 bad file of 6 (exit 0, the final line says why), and a model asking a
    GPU with `device: auto` on a machine without one (CUDA_VISIBLE_DEVICES empty: none, even on a GPU host),
    said by `validate` and `run` in one line. The run starts its own local Ray (`local_ray`): "no GPU here"
    is the plan of a new local Ray on this machine; a joined cluster that can never get a GPU refuses it
    (`test_a_plain_joined_head_has_no_autoscaler_and_refuses_the_gpu`)."""
    from test_jobs_support import vlbatch, write_job

    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=6, model_num_gpus=1)
    (tmp_path / "wd" / "media" / "img003.png").write_bytes(b"not a png at all")
    sets, env = ["--set", "model.device=auto"], {"CUDA_VISIBLE_DEVICES": ""}
    cpu_line = "the model will run on the CPU: no GPU here (resources.model.num_gpus=1, model.device=auto"
    checked = vlbatch("validate", str(cfg), *sets, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"  device: {cpu_line}" in checked.stdout
    run = vlbatch("run", str(cfg), "--no-lock", "--set", "output.run_id=onebad", *sets, env=env, local_ray=True)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert sum(cpu_line in line for line in run.stdout.splitlines()) == 1, out[-3000:]
    last = [line for line in run.stdout.splitlines() if line.startswith("[vlbatch] done:")][-1]
    assert "5 ok, 1 error" in last and "all rows written" in last
    assert "17% > max_error_fraction 5%, 1 < min_error_rows 10: exit 0" in last
