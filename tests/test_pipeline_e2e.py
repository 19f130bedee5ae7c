"""Acceptance: the whole pipeline on a real local Ray cluster, output to a moto S3 server
on loopback through s3fs, real encoded sample media (images, videos, bad files).

One Ray (the session's, tests/conftest.py, restarted once with the fake S3 credentials in its
environment) and one moto server serve the module. The reference for every answer
is the engine alone (vlbatch.operators.media + vlbatch.operators.preprocess + vlbatch.operators.engine called
directly, no Ray), computed in the same run.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parent.parent
BAD_TYPES = {  # name -> error_type the row must carry
    "truncated.jpg": "MediaError", "zero.png": "MediaError", "not_image.png": "MediaError",
    "truncated.mp4": "MediaError", "zero.mp4": "MediaError", "not_media.mp4": "MediaError",
    "garbage.webm": "MediaError", "audio_only.m4a": "InputError",  # audio, refused by its extension
    "aspect_1x300.png": "InputError", "no_extension_file": "InputError",
}
MISSING = "missing_file.jpg"  # an 11th kind: the object does not exist


def wait_until(pred, timeout: float, what: str):
    """Poll a condition (synchronisation on an observable state, not a fixed sleep)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_ckpt, session_ray_holder):
    """moto S3 server + the session's Ray + sample media + a tiny checkpoint."""
    import boto3
    import numpy as np
    import ray
    from conftest import start_session_ray
    from moto.server import ThreadedMotoServer
    from PIL import Image

    from vlbatch.devtools.samples import write_all

    saved = {k: os.environ.get(k) for k in AWS}
    os.environ.update(AWS)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="out")
    s3.create_bucket(Bucket="media")
    root = tmp_path_factory.mktemp("e2e")
    manifest = write_all(root / "media")
    good = [i["path"] for i in manifest["images"] if not i["bad"]][:5] + \
        [v["path"] for v in manifest["videos"] if not v["bad"]][:4]
    bad = {Path(x["path"]).name: x["path"] for x in manifest["images"] + manifest["videos"] if x["bad"]}
    Image.fromarray(np.zeros((300, 1, 3), np.uint8)).save(root / "aspect_1x300.png")
    bad["aspect_1x300.png"] = str(root / "aspect_1x300.png")
    (root / "no_extension_file").write_bytes(b"\x00" * 64)
    bad["no_extension_file"] = str(root / "no_extension_file")
    for p in good:  # the same media on S3 for the S3-input test
        s3.upload_file(p, "media", Path(p).name)
    # The session's Ray (2 CPUs), started again now: Ray Data's actors write s3://out with the credentials of
    # their raylet's environment, which is this process's at the start, not its os.environ later. The
    # autouse `ray_cluster` of each test then finds this process on it and keeps it.
    for attempt in range(3):  # Ray gives a raylet 30 s to register; a loaded CI box can miss that
        try:
            session_ray_holder[:] = [start_session_ray()]
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield {"server": server, "endpoint": endpoint, "root": root, "good": good, "bad": bad,
           "ckpt": str(tiny_ckpt("dense")), "gcs": session_ray_holder[0].address}
    # no fake credentials for the rest of the session: the environment as it was, and the next test marked
    # `ray` starts the session's Ray again without them
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    ray.shutdown()
    server.stop()


def job(env, name: str, media: list[str], *, questions: dict | None = None, **over) -> dict:
    """A job config dict: jsonl manifest of `media`, output s3://out/<name>."""
    man = env["root"] / f"{name}.jsonl"
    lines = [{"media_uri": m, **({"qs": questions[m]} if questions else {})} for m in media]
    man.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = {
        "model": {"path": env["ckpt"], "backend": "engine", "dtype": "float32", "device": "cpu",
                  "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 1024}},
        "input": {"uri": str(man), "format": "jsonl",
                  "columns": {"media": "media_uri", "media_type": None, "questions": "qs" if questions else None}},
        "task": {"mode": "questions"} if questions else {"mode": "caption", "prompt": "Describe.",
                                                           "video_prompt": "What happens?"},
        "sampling": {"max_tokens": 6},
        "image": {"max_pixels": 65536}, "video": {"fps": 2.0, "max_frames": 8, "max_pixels": 16384,
                                                   "decode_timeout_s": 30},
        "resources": {"decode": {"num_cpus": 0.5, "batch_size": 4, "max_actors": 1},
                      "preprocess": {"num_cpus": 0.5, "batch_size": 4, "max_actors": 1},
                      # 0.5: every pool fits the session's 2 CPUs; one torch thread either way (max(1, int(num_cpus)))
                      "model": {"num_cpus": 0.5, "batch_visual_tokens": 512, "batch_size": 4},
                      "write": {"num_cpus": 0.25, "batch_size": 4}},
        # part_rows=1: every write batch is published as its own part at once (the kill tests wait on parts)
        "output": {"uri": "s3://out", "run_id": name, "part_rows": 1},
        "storage": {"endpoint_url": env["endpoint"], "region": "us-east-1", "retries": 6},
        "max_error_fraction": 1.0,
    }
    for k, v in over.items():
        node = cfg
        *path, last = k.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return cfg


def _sink(env, run: str):
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.operators.storage import StorageOptions

    return ParquetSink(f"s3://out/{run}", StorageOptions(endpoint_url=env["endpoint"], region="us-east-1"))


def output(env, run: str):
    return _sink(env, run).read().to_pylist()


def engine_alone(cfg_dict: dict, reqs: list[tuple[str, str, str]]) -> dict[str, str]:
    """Answers of the engine alone for (id, media path, prompt), no Ray, no pipeline code."""
    from dataclasses import replace

    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.factory import load_engine
    from vlbatch.operators.media.video import FrameSampling
    from vlbatch.operators.media.worker import decode_video
    from vlbatch.operators.preprocess import Processor, load_image

    ck, v = cfg_dict["model"]["path"], cfg_dict["video"]
    proc = Processor.from_pretrained(ck)
    proc.image_config = replace(proc.image_config, max_pixels=cfg_dict["image"]["max_pixels"])
    proc.video_config = replace(proc.video_config, max_pixels=v["max_pixels"])
    from vlbatch.pipeline.config import EngineBudgets

    engine = load_engine(ck, device="cpu", **EngineBudgets(**cfg_dict["model"]["engine"]).engine_kwargs())
    requests = []
    for rid, path, prompt in reqs:
        data = Path(path).read_bytes()
        kind = "video" if path.endswith((".mp4", ".webm", ".avi")) else "image"
        media = {"images": [load_image(data)]} if kind == "image" else \
            {"videos": [decode_video(data, FrameSampling(fps=v["fps"], max_frames=v["max_frames"]))]}
        text = proc.apply_chat_template([{"role": "user", "content": [{"type": kind}, {"type": "text", "text": prompt}]}],
                                        add_generation_prompt=True, enable_thinking=False)
        requests.append(Request.from_processor(rid, proc(text=text, **media), 0,
                                               sampling=SamplingParams(max_new_tokens=cfg_dict["sampling"]["max_tokens"])))
    return {r.id: r.text for r in engine.generate(requests)}


def _ray_workers(match: str) -> list[int]:
    """pids of this test's Ray worker processes (children of our raylet) whose title holds `match`.

    Ray titles an actor's process `ray::<actor repr>`, e.g. `ray::MapWorker(MapBatches(ModelStage))`.
    Other sessions' Ray clusters on the same machine have other raylets and are never touched.
    """
    import ray

    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            title = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == raylet and title.startswith("ray::") and match in title:
            out.append(int(d))
    return out


def _kill_model_actor() -> int:
    """SIGKILL the process of a live model-stage actor; returns its pid (0 if none is alive)."""
    pids = _ray_workers("ModelStage")
    if pids:
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]
    return 0


def _parts(env, run: str) -> list[str]:
    return _sink(env, run).parts()


@pytest.fixture(scope="module")
def captions(env):
    """The caption job over good + bad media; its model actor is SIGKILLed mid-run."""
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job

    media = env["good"] + list(env["bad"].values()) + [str(env["root"] / MISSING)]
    cfg = job(env, "captions", media, resources__model__batch_size=1, resources__write__batch_size=1)
    killed: list = []

    def killer():
        try:
            # and a model actor up: on a loaded 2-CPU box the bad media's error rows can be committed while
            # the model actor is still starting (no process titled ModelStage yet)
            wait_until(lambda: len(_parts(env, "captions")) >= 2 and _ray_workers("ModelStage"), 300,
                       "first commits and a live model actor")
            killed.append(_kill_model_actor())
        except Exception as e:  # surfaced by the test's assertion
            killed.append(e)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    summary = run_job(validate_config(cfg))
    t.join(timeout=10)
    return cfg, media, summary, output(env, "captions"), killed


def test_captions_mixed_media_with_bad_files(env, captions):
    from vlbatch.pipeline.stages.requests import request_id

    cfg, media, summary, rows, _ = captions
    assert len(rows) == len(media) == len({r["id"] for r in rows})  # every input exactly once
    by_uri = {r["media_uri"]: r for r in rows}
    assert set(by_uri) == set(media)
    for name, path in env["bad"].items():
        r = by_uri[path]
        assert r["status"] == "error" and r["error_type"] == BAD_TYPES[name], (name, r["error_message"])
        assert r["answer"] is None and r["error_message"]
    assert by_uri[str(env["root"] / MISSING)]["status"] == "error"
    good = [by_uri[p] for p in env["good"]]
    assert all(r["status"] == "ok" and r["answer"] is not None and r["generated_tokens"] >= 1 for r in good), \
        [r["error_message"] for r in good]
    prompt = {p: ("What happens?" if p.endswith((".mp4", ".webm", ".avi")) else "Describe.") for p in env["good"]}
    for p in env["good"]:
        assert by_uri[p]["id"] == request_id(p, 0, prompt[p]) and by_uri[p]["prompt"] == prompt[p]
    ref = engine_alone(cfg, [(request_id(p, 0, prompt[p]), p, prompt[p]) for p in env["good"]])
    assert {r["id"]: r["answer"] for r in good} == ref
    assert summary.committed_total == len(media) and summary.duplicate_ids == 0
    assert summary.committed_by_status == {"ok": len(env["good"]), "error": len(media) - len(env["good"])}
    assert summary.exit_code == 0  # max_error_fraction 1.0
    assert summary.error_types["MediaError"] >= 8
    sink = _sink(env, "captions")
    on_disk = json.loads(sink.fs.cat_file(f"{sink.root}/_summary.json"))  # the summary beside the output
    assert on_disk == json.loads(summary.to_json()) and on_disk["committed_by_status"]["ok"] == len(env["good"])


def test_model_actor_killed_mid_run_loses_and_duplicates_nothing(captions):
    _, media, summary, rows, killed = captions
    assert killed and isinstance(killed[0], int) and killed[0] > 0, f"no model actor was killed mid-run: {killed}"
    assert sorted(r["media_uri"] for r in rows) == sorted(media)  # none lost, none twice
    assert summary.duplicate_ids == 0 and summary.committed_total == len(media)


def test_driver_sigkill_then_rerun_resumes(env, captions, tmp_path):
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job

    _, media, _, ref_rows, _ = captions
    cfg = job(env, "sigkill", media, resources__model__batch_size=1, resources__write__batch_size=1)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "from vlbatch.pipeline.config import load_config; from vlbatch.pipeline.graph import run_job; "
            "run_job(load_config(sys.argv[2]))")
    proc = subprocess.Popen([sys.executable, "-c", code, env["gcs"], str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(_parts(env, "sigkill")) >= 3 or proc.poll() is not None, 300, "first commits")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the driver finished before it could be killed"
    _wait_job_workers_gone()
    fs = _sink(env, "sigkill").fs
    before = {p: fs.info(p)["ETag"] for p in _parts(env, "sigkill")}
    n_before = sum(_rows(fs, p) for p in before)
    summary = run_job(validate_config(cfg))
    rows = output(env, "sigkill")
    key = lambda r: (r["status"], r["answer"], r["error_type"])  # noqa: E731
    assert {r["id"]: key(r) for r in rows} == {r["id"]: key(r) for r in ref_rows}
    assert len(rows) == len(ref_rows)
    # the rerun did not recompute committed rows: they were skipped and their files are untouched
    assert summary.requests_skipped == n_before and summary.requests_computed == len(media) - n_before
    after = {p: fs.info(p)["ETag"] for p in _parts(env, "sigkill")}
    assert all(after.get(p) == tag for p, tag in before.items())


def _rows(fs, path) -> int:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def _wait_job_workers_gone():
    """After a driver dies Ray kills its workers; wait until none of its Ray Data actors is alive."""
    wait_until(lambda: not _ray_workers("MapWorker"), 120, "the dead driver's actors to exit")


def test_questions_from_s3_with_s3_outage_during_writing(env):
    """Several questions per media read from S3; the S3 server stops after the first commit
    and comes back: retries absorb it, or the job fails clearly and a rerun completes it."""
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job
    from vlbatch.pipeline.stages.requests import request_id

    uris = [f"s3://media/{Path(p).name}" for p in env["good"]]
    qs = {u: [f"Question {k} about it?" for k in range(1 + i % 3)] for i, u in enumerate(uris)}
    cfg = job(env, "questions", uris, questions=qs, resources__write__batch_size=1,
              resources__model__batch_size=2, resources__fuse_cpu_stages=False)  # decode, preprocess: 2 pools
    server, events = env["server"], []

    def outage():
        try:
            wait_until(lambda: len(_parts(env, "questions")) >= 1, 300, "first commit")
        except Exception as e:
            events.append(e)
            return
        server.stop()
        events.append("stopped")
        threading.Event().wait(2.0)  # the outage being tested, not a synchronisation
        server.start()
        events.append("started")

    t = threading.Thread(target=outage, daemon=True)
    t.start()
    runs = 1
    try:
        summary = run_job(validate_config(cfg))
    except Exception:  # failed clearly (StorageError after retries): resume must complete it
        summary = None
    t.join(timeout=60)
    assert events == ["stopped", "started"]
    if summary is None or summary.committed_by_status.get("error"):
        summary = run_job(validate_config(cfg))  # transient error rows are retried, ok rows skipped
        runs += 1
    rows = output(env, "questions")
    expect = {request_id(u, k, q): (u, k, q) for u in uris for k, q in enumerate(qs[u])}
    assert sorted(r["id"] for r in rows) == sorted(expect)  # every request exactly once
    assert all(r["status"] == "ok" for r in rows), [r["error_message"] for r in rows if r["status"] != "ok"]
    assert all((r["media_uri"], r["request_index"], r["prompt"]) == expect[r["id"]] for r in rows)
    local = {f"s3://media/{Path(p).name}": p for p in env["good"]}
    ref = engine_alone(cfg, [(rid, local[u], q) for rid, (u, k, q) in expect.items()])
    assert {r["id"]: r["answer"] for r in rows} == ref
    assert summary.duplicate_ids == 0
    if runs == 1:  # siblings met the same actor's prefix cache in this run
        assert summary.prefix_cache_hit_rate > 0


def test_rerun_retries_transient_error_rows_and_keeps_the_rest(env, captions):
    """Turn one committed ok row into a transient EngineError row (what an actor death
    leaves); a rerun recomputes exactly that request and keeps every other row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.graph import run_job

    cfg, media, _, ref_rows, _ = captions
    sink = _sink(env, "captions")
    victim = next(r for r in ref_rows if r["status"] == "ok")
    for p in _parts(env, "captions"):
        t = sink.read_part(p)
        if victim["id"] in t.column("id").to_pylist():
            hit = pc.equal(t.column("id"), victim["id"])
            t = t.set_column(t.schema.get_field_index("status"), "status",
                             pc.if_else(hit, pa.scalar("error"), t.column("status")))
            t = t.set_column(t.schema.get_field_index("error_type"), "error_type",
                             pc.if_else(hit, pa.scalar("EngineError"), t.column("error_type")))
            sink.fs.rm_file(p)
            sink.commit(t)
    summary = run_job(validate_config(cfg))
    assert summary.purged_transient == 1 and summary.requests_computed == 1
    assert summary.requests_skipped == len(media) - 1  # permanent error rows are kept, not retried
    rows = output(env, "captions")
    key = lambda r: (r["status"], r["answer"], r["error_type"])  # noqa: E731
    assert {r["id"]: key(r) for r in rows} == {r["id"]: key(r) for r in ref_rows}
