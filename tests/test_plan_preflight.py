"""Issue 49: one plan (`pipeline/plan/spec.py`) and one preflight (`pipeline/plan/preflight.py`).

- `vlbatch validate` and `vlbatch run` run the same checks, once each, in the same order (validate
  used to skip the output check; run used to check the output and the fingerprint twice);
- `vlbatch validate` refuses a missing output bucket, as `vlbatch run` does (moto's S3 server);
- the stage list is the one layout: the graph's classes, the plan line, validate's pools and the
  fit checks all come from it.
Real parts throughout: a tiny checkpoint, a real manifest, moto in server mode, no Ray started.
"""
from __future__ import annotations

import argparse
import re

import pytest

from vlbatch.pipeline.config import load_config, validate_config

CHECKS = ("check_paths", "open_source", "check_model", "check_output", "check_fingerprint", "check_plan")


def _job(tmp_path, tiny_ckpt, *extra: str):
    from test_jobs_support import write_job

    path = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2)
    return path, list(extra)


@pytest.fixture
def calls(monkeypatch):
    """The preflight's checks, each recorded as it is called (then run for real)."""
    from vlbatch.pipeline.plan import preflight

    seen: list[str] = []
    for name in CHECKS:
        real = getattr(preflight, name)

        def record(*a, _real=real, _name=name, **k):
            seen.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(preflight, name, record)
    return seen


def test_validate_and_run_run_the_same_checks_once_in_the_same_order(tmp_path, tiny_ckpt, calls, monkeypatch,
                                                                     capsys):
    """On today's main validate runs paths, fingerprint, checkpoint, plan (no output check) and run runs
    paths, output, fingerprint, checkpoint, plan, then output and fingerprint again in `run_job`."""
    from vlbatch.jobs.commands import cmd_validate
    from vlbatch.jobs.local import run_plan

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the plan on this machine as a local Ray sees it
    path, overrides = _job(tmp_path, tiny_ckpt)
    args = argparse.Namespace(config=str(path), overrides=overrides, address=None, json=False,
                              allow_config_change=False)
    assert cmd_validate(args) == 0
    validated = list(calls)
    calls.clear()
    plan = run_plan(load_config(path, overrides), new_local=True)
    assert validated == list(CHECKS), validated
    assert calls == list(CHECKS), calls
    out = capsys.readouterr().out
    pools = re.search(r"reserves ([\d.]+) CPUs, ([\d.]+) GPUs", out).groups()
    assert pools == re.search(r"reserves ([\d.]+) CPUs, ([\d.]+) GPUs", plan.line()).groups(), (out, plan.line())


def test_validate_refuses_a_missing_output_bucket(s3_server, tmp_path, tiny_ckpt, capsys):
    """`vlbatch run` refused it before Ray starts; `vlbatch validate` said `valid` on today's main."""
    from vlbatch.jobs.cli import main

    path, _ = _job(tmp_path, tiny_ckpt)
    sets = ["--set", "output.uri=s3://no-such-validate-bucket/out", "--set", f"storage.endpoint_url={s3_server.endpoint_url}",
            "--set", "storage.region=us-east-1", "--set", "storage.retries=1"]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env.items():
            mp.setenv(k, v)
        assert main(["validate", str(path), *sets]) == 2
    err = capsys.readouterr().err
    assert "output.uri: the bucket 'no-such-validate-bucket'" in err and "never created" in err, err
    names = [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]
    assert "no-such-validate-bucket" not in names  # never created


@pytest.mark.parametrize(("resources", "mode", "names"), [
    ({}, "caption", ["decode+preprocess", "model", "write"]),
    ({"fuse_cpu_stages": False}, "caption", ["decode", "preprocess", "model", "write"]),
    ({}, "scan", ["decode+preprocess+write (scan)"]),
])
def test_one_stage_list_drives_the_graph_the_plan_line_and_the_fit(tmp_path, resources, mode, names):
    from vlbatch.pipeline.graph import _load
    from vlbatch.pipeline.plan.cluster import Cluster
    from vlbatch.pipeline.plan.fit import fit_problems
    from vlbatch.pipeline.plan.spec import plan, pools

    (tmp_path / "a.png").write_bytes(b"")
    task = {"mode": mode} if mode != "scan" else {"mode": "scan"}
    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": str(tmp_path / "*.png"), "format": "glob"},
                           "task": task, "resources": resources, "output": {"uri": str(tmp_path / "out")}})
    cluster = Cluster(cpus=64.0, gpus=0.0, memory_bytes=64 << 30, fixed_size=True, where="a big machine")
    p = plan(cfg, cluster)
    assert [s.name for s in p.stages] == names
    for s in p.stages:  # every spec names a real stage class, taking its kwargs
        cls = _load(s.target)
        assert isinstance(cls, type) and set(s.kwargs) | set(s.runtime) <= set(cls.__init__.__code__.co_varnames)
    assert [x.field for x in p.pools()] == [x.field for x in pools(cfg, cluster)]  # what the fit checks read
    cpus = sum(x.actor_cpus * x.min_actors for x in p.pools())
    assert f"reserves {cpus:.2f} CPUs" in p.line() and f"reserves {cpus:.2f} CPUs" in p.pools_line()
    for s in p.stages:
        assert s.name in p.line()
    assert not fit_problems(cfg, cluster)
    small = Cluster(cpus=cpus - 0.5, gpus=0.0, memory_bytes=64 << 30, fixed_size=True, where="a small machine")
    assert f"need {cpus:.2f} CPUs" in fit_problems(cfg, small)[0]
