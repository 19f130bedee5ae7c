"""Issue 48 item 10, "Messages": what a user reads when something goes wrong says what went wrong.

Unit-level where the defect is in one function: the run id of a long `--name` with `--slot`, `inspect`
on s3:// without an endpoint, the GPU figure of `validate` and of the run's plan line, stale temp
files of a failed start, and a full disk's message. The end-to-end checks (a full disk on a real
tmpfs, a SIGKILLed driver) are in tests/test_run_teardown.py."""
from __future__ import annotations

import errno
import hashlib

import pytest

from vlbatch.operators.errors import StorageError
from vlbatch.pipeline.config import load_config, validate_config

SLOT = "20261129T0200"


# ---- a long --name with --slot: the run id it derives is a valid run id ----

def test_a_long_name_with_a_slot_gives_a_valid_run_id(tmp_path, tiny_ckpt):
    """Today `vlb-<150 chars>-<slot>` (167 characters) fails output.run_id's pattern ({1,128}) though
    the user set no run_id. The id is shortened with a hash of the whole name: deterministic, distinct
    per name and per slot, and its slot still readable."""
    from test_jobs_support import write_job

    from vlbatch.jobs.scheduling import submission_id
    from vlbatch.jobs.spec import build_spec

    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=1)
    long_a, long_b = "a" * 150, "a" * 149 + "b"
    sid = submission_id(long_a, SLOT)
    assert len(sid) <= 128 and sid.startswith("vlb-aaaa") and sid.endswith(f"-{SLOT}"), sid
    assert sid == submission_id(long_a, SLOT)  # a retried tick: the same id
    assert sid != submission_id(long_b, SLOT) and sid != submission_id(long_a, "20261129T0300")
    assert submission_id("cap", SLOT) == f"vlb-cap-{SLOT}"  # short ids are unchanged
    assert load_config(cfg, [f"output.run_id={sid}"]).output.run_id == sid  # main: a run_id pattern error
    spec = build_spec(cfg, workdir=tmp_path / "wd", name=long_a, slot=SLOT)
    assert spec.run_id == sid and load_config(cfg, [f"output.run_id={spec.run_id}"])


# ---- inspect s3://... without an endpoint: one line naming the cause, exit non-zero ----

def test_inspect_s3_without_endpoint_or_credentials_is_one_line(tmp_path, monkeypatch, capsys):
    """No endpoint and no credentials: today botocore's NoCredentialsError escapes as a ~100-line
    traceback. Credentials are made unavailable through the AWS chain's own variables (no network
    call is made: signing fails first)."""
    from vlbatch.jobs.inspect.text import run_inspect

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code = run_inspect("s3://some-bucket/run-1", sample=0)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "s3://some-bucket/run-1" in err and "credentials" in err.lower() and "--endpoint-url" in err, err


# ---- validate's GPU figure and the run's plan line agree ----

def _gpu_config(tmp_path, tiny_ckpt):
    """model.device auto with resources.model.num_gpus 64: on a machine without GPUs the model runs on
    the CPU and reserves none (pipeline/plan/spec.model_gpus)."""
    from test_jobs_support import write_job

    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2, model_num_gpus=64)
    return load_config(cfg, ["model.device=auto"])


def test_validate_and_the_run_plan_print_the_same_gpu_figure(tmp_path, tiny_ckpt):
    """Today validate says `0 GPUs` (the machine's) and the run's plan line `reserves 64 GPUs` (the
    config's, unresolved). Both now print what the pools reserve on that cluster: 0 GPUs."""
    import re

    from vlbatch.pipeline.plan.cluster import Cluster
    from vlbatch.pipeline.plan.fit import check_plan
    from vlbatch.pipeline.plan.spec import plan

    config = _gpu_config(tmp_path, tiny_ckpt)
    cluster = Cluster(cpus=2.0, gpus=0.0, memory_bytes=8 << 30, fixed_size=True, where="this machine")
    config, _ = check_plan(config, cluster)
    validate = plan(config, cluster).pools_line()
    run = plan(config, cluster).line()
    pat = re.compile(r"reserves ([\d.]+) CPUs, ([\d.]+) GPUs")
    assert pat.search(validate) and pat.search(run), (validate, run)
    assert pat.search(validate).groups() == pat.search(run).groups() == (pat.search(run).group(1), "0"), \
        (validate, run)
    assert "64 GPU" not in run, run


def test_the_cli_run_prints_the_plan_validate_printed(tmp_path, tiny_ckpt, monkeypatch, capsys):
    """`vlbatch validate` and the plan line `vlbatch run` prints before Ray starts (jobs/local.run_plan),
    on this machine with its GPUs hidden (CUDA_VISIBLE_DEVICES empty: a local Ray would see none)."""
    import re

    from vlbatch.jobs.cli import main
    from vlbatch.jobs.local import run_plan

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = _gpu_config(tmp_path, tiny_ckpt)
    cfg = tmp_path / "wd" / "job.yaml"
    assert main(["validate", str(cfg), "--set", "model.device=auto"]) == 0
    validate = capsys.readouterr().out
    plan = run_plan(config, new_local=True)
    pat = re.compile(r"reserves ([\d.]+) CPUs, ([\d.]+) GPUs")
    assert pat.search(validate).groups() == pat.search(plan.line()).groups(), (validate, plan.line())
    assert pat.search(plan.line()).group(2) == "0", plan.line()


# ---- stale temp files of a failed start are removed by the next start ----

def test_a_successful_start_removes_stale_fingerprint_temp_files(tmp_path, tiny_ckpt):
    """A failed start left `_fingerprint.json.<32 hex>.vlbatch-tmp` (and the summary's) in the run
    folder; today they survive every later run. `record_fingerprint` (each start) removes its own; the
    sink's `prepare` the summary's; a file that only looks alike (another name, not 32 hex) stays."""
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.pipeline.plan.fingerprint import record_fingerprint

    cfg = validate_config({"model": {"path": str(tiny_ckpt("dense")), "device": "cpu"}, "input": {"uri": "x"},
                           "output": {"uri": str(tmp_path / "out"), "run_id": "r1"}})
    run = tmp_path / "out" / "r1"
    run.mkdir(parents=True)
    hexes = [hashlib.md5(str(i).encode()).hexdigest() for i in range(3)]
    stale = [run / f"_fingerprint.json.{hexes[0]}.vlbatch-tmp", run / f"_summary.json.{hexes[1]}.vlbatch-tmp"]
    foreign = [run / "_fingerprint.json.mine.vlbatch-tmp", run / f"notes.json.{hexes[2]}.vlbatch-tmp"]
    for p in stale + foreign:
        p.write_text("{")
    record_fingerprint(cfg)
    record_fingerprint(cfg)  # a resume with the same config: nothing to write, still tidied
    ParquetSink(str(run)).prepare()
    assert (run / "_fingerprint.json").is_file()
    assert [p.name for p in stale if p.exists()] == []
    assert all(p.exists() for p in foreign)


def test_a_failed_atomic_write_leaves_no_temp_file(tmp_path):
    """`put_atomic` whose write fails after its temp file was opened (here: data that is not bytes)
    removes that temp file; today it stays beside the target."""
    from vlbatch.operators.storage import filesystem, put_atomic

    fs, path = filesystem(str(tmp_path / "f.json"), _storage())
    with pytest.raises(TypeError):
        put_atomic(fs, path, object(), _storage())  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def _storage():
    from vlbatch.operators.storage import StorageOptions

    return StorageOptions(max_attempts=1)


# ---- a full disk: "no space left on <path>" ----

def test_enospc_in_an_atomic_write_names_the_folder(tmp_path, monkeypatch):
    """An OSError(ENOSPC) raised while a file is written (as a full disk raises it when the file is
    closed) becomes `StorageError: no space left on <folder>`, with no temp file left behind."""
    from vlbatch.operators.storage import filesystem, put_atomic
    from vlbatch.operators.storage import io as storage_io

    fs, path = filesystem(str(tmp_path / "run" / "part.parquet"), _storage())
    (tmp_path / "run").mkdir()
    real_open = fs.open

    class Full:  # the local file's close raising ENOSPC (mocked: a full disk cannot be made unprivileged here)
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self.f.__enter__()

        def __exit__(self, *exc):
            self.f.__exit__(*exc)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "open", lambda p, mode="rb", **kw: Full(real_open(p, mode, **kw)))
    with pytest.raises(StorageError, match=r"no space left on .*run"):
        put_atomic(fs, path, b"x" * 10, _storage())
    assert list((tmp_path / "run").iterdir()) == []
    assert storage_io  # the module under test


# What the driver caught when a writer's disk filled (a real run on a full tmpfs, kept short): Ray's
# RayTaskError(UserCodeException), whose text holds the UDF's error and then Ray's envelope; its context
# a StopIteration, then Ray's ObjectRefStreamEndOfStreamError with an empty message.
RAY_TEXT = """\x1b[36mray::MapWorker(MapBatches(WriteStage)).submit()\x1b[39m (pid=10027, ip=192.0.2.2)
  File "/work/h5/operators/storage/io.py", line 190, in _put_once
    with fs.open(tmp, "wb") as f:
vlbatch.operators.errors.StorageError: no space left on /data/out/run-1/_tmp/staged/w-1 (writing part-1.parquet)

The above exception was the direct cause of the following exception:

\x1b[36mray::MapWorker(MapBatches(WriteStage)).submit()\x1b[39m (pid=10027, ip=192.0.2.2)
ray.exceptions.UserCodeException: UDF failed to process a data block.
Failed to apply UDF transform after 1/1 attempts (total backoff 0.0s)."""


def test_describe_names_a_full_disk_not_the_stream_end(tmp_path):
    """Today the line is `ObjectRefStreamEndOfStreamError: ` (the text's last exception line is Ray's
    UserCodeException envelope, skipped, and the chain ends in the empty stream-end error)."""
    from ray.exceptions import ObjectRefStreamEndOfStreamError

    from vlbatch.jobs.failures import describe

    class RayTaskError(Exception):  # stands for ray's dynamic RayTaskError(UserCodeException): its text
        pass

    def raised(text: str) -> BaseException:
        try:
            try:
                try:
                    raise ObjectRefStreamEndOfStreamError()
                except ObjectRefStreamEndOfStreamError:
                    raise StopIteration from None
            except StopIteration:
                raise RayTaskError(text)  # noqa: B904 - Ray raises it while handling the stream's end
        except RayTaskError as e:
            return e

    line = describe(raised(RAY_TEXT), None, tmp_path / "log").line
    assert "the write stage failed" in line and "StorageError: no space left on /data/out/run-1/_tmp/staged/w-1" \
        in line and "ObjectRefStreamEndOfStream" not in line and "UDF failed" not in line, line
    plain = RAY_TEXT.replace("vlbatch.operators.errors.StorageError: no space left on /data/out/run-1/_tmp/staged/w-1"
                             " (writing part-1.parquet)", "OSError: [Errno 28] No space left on device")
    line = describe(raised(plain), None, tmp_path / "log").line
    assert "OSError: [Errno 28] No space left on device" in line and "UDF failed" not in line, line


# ---- a killed driver's processes: the reaper (jobs/reaper.py), without Ray ----

DRIVER = """
import subprocess, sys, time
from vlbatch.jobs.reaper import reaped_ray
with reaped_ray():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
"""


def test_the_reaper_ends_a_killed_drivers_children():
    """A stand-in driver marks its session (`reaped_ray`) and starts a long-lived child, as `ray.init`
    starts Ray's processes; SIGKILL the driver: the child goes (bounded poll, generous limit)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from vlbatch.jobs.reaper import supported

    if not supported():
        pytest.skip("the reaper reads /proc (Linux)")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    child = int(driver.stdout.readline())
    try:
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 60
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the driver's child outlived it"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


HIDDEN = """
import subprocess, sys, time
from vlbatch.jobs.reaper import reaped_ray
with reaped_ray():
    inner = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env={}); print(c.pid, flush=True); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", inner], stdout=subprocess.PIPE, text=True)
    print(parent.pid, parent.stdout.readline().strip(), flush=True)
    time.sleep(600)
"""


def test_the_reaper_ends_a_process_whose_mark_is_hidden():
    """A grandchild started with an empty environment (as a process whose title overwrote its mark reads
    in /proc) under a marked parent still alive: found through the tree at EOF."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from vlbatch.jobs.reaper import supported

    if not supported():
        pytest.skip("the reaper reads /proc (Linux)")
    driver = subprocess.Popen([sys.executable, "-c", HIDDEN], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in driver.stdout.readline().split()]
    try:
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a process of the session outlived the driver"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_noted_processes_are_reaped_after_their_parent_died():
    """`watch`'s notes: a process without the mark, noted while its parent (the driver stand-in) lived,
    is reaped after that parent's death made it the init process's child; an unnoted one is not."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from vlbatch.jobs import reaper

    if not reaper.supported():
        pytest.skip("the reaper reads /proc (Linux)")
    code = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env={}, start_new_session=True); print(c.pid, flush=True); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={})
    child = int(parent.stdout.readline())
    try:
        noted = reaper._family(reaper._scan("none"), frozenset({(parent.pid, reaper._scan("none")[parent.pid].start)}))
        assert reaper.session_pids("none") == []  # nothing marked: without the notes nothing is found
        parent.kill()
        parent.wait()
        reaper.reap("none", noted, grace_s=5)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
