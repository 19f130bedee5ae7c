"""Files a job config names (issue 60, item 1): `schema_file`, the job config itself, the checkpoint's small
files, `--runtime-env`. Each is read only when it is a regular file within its kind's cap
(`operators/storage/named_file.py`); /dev/zero, a FIFO, a directory, a file over the cap: one line naming
the field, at once. A FIFO test never hangs if this regresses: a thread of the test opens the writer side
(and writes a valid schema), so an old blocking open returns and the test fails on its assertion."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import load_config, validate_config

REPO = Path(__file__).resolve().parents[1]
JOB = "model: {path: /m}\ninput: {uri: /x.jsonl}\noutput: {uri: /o}\ntask:\n  mode: questions\n"


def _job_with_schema_file(tmp_path: Path, schema_file: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(JOB + f"  questions:\n    - {{name: tags, prompt: Tag it., response_format: "
                       f"{{type: json_schema, schema_file: {json.dumps(schema_file)}}}}}\n")
    return p


@contextlib.contextmanager
def _fifo_with_writer(path: Path, payload: bytes = b'{"type": "object"}'):
    """A FIFO at `path` whose writer side a thread of this test opens as soon as a reader has it open (and
    writes `payload`): a reader that blocks on the open is released. Stopped when the block ends."""
    os.mkfifo(path)
    stop = threading.Event()

    def write():
        while not stop.is_set():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                stop.wait(0.01)
                continue
            try:
                os.set_blocking(fd, True)  # the whole payload, however slowly the reader takes it
                with contextlib.suppress(BrokenPipeError):
                    os.write(fd, payload)
            finally:
                os.close(fd)
            return

    t = threading.Thread(target=write, daemon=True)
    t.start()
    try:
        yield path
    finally:
        stop.set()
        t.join()


def _refused(config: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(config)
    return str(err.value)


def _one_line(msg: str) -> str:
    lines = msg.splitlines()[1:] if msg.startswith("invalid job config:") else msg.splitlines()
    assert len(lines) == 1, msg
    return lines[0].strip()


def test_schema_file_that_is_a_fifo_is_refused_at_once(tmp_path):
    with _fifo_with_writer(tmp_path / "schema.json") as fifo:
        line = _one_line(_refused(_job_with_schema_file(tmp_path, str(fifo))))
    assert line.startswith(f"task.questions.0.response_format: schema_file: cannot read {fifo}: not a regular file"
                           ), line


def test_schema_file_that_is_a_directory_is_refused(tmp_path):
    line = _one_line(_refused(_job_with_schema_file(tmp_path, str(tmp_path))))
    assert line == (f"task.questions.0.response_format: schema_file: cannot read {tmp_path}: a directory, not a "
                    "file"), line


def test_schema_file_over_1_mib_is_refused_unread(tmp_path):
    big = tmp_path / "big.json"  # a valid JSON Schema of 2 MB: its size alone refuses it
    big.write_text(json.dumps({"type": "string", "description": "x" * (2 << 20)}))
    line = _one_line(_refused(_job_with_schema_file(tmp_path, str(big))))
    assert line.startswith(f"task.questions.0.response_format: schema_file: cannot read {big}: ") and \
        "over the 1 MiB limit of a schema file" in line, line


def test_schema_file_within_its_cap_is_read(tmp_path):
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"type": "object"}))
    cfg = load_config(_job_with_schema_file(tmp_path, str(ok)))
    assert cfg.task.prompt_formats() == {"tags": ("json_schema", '{"type": "object"}')}


def _validate_bounded(config: str) -> subprocess.CompletedProcess:
    """`vlbatch validate CONFIG` (the real CLI) under a 3 GB address-space limit: reading /dev/zero
    would end in a MemoryError here, never take the machine's memory."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "vlbatch.jobs.cli", "validate", config], capture_output=True,
                          text=True, env=env, cwd=REPO, preexec_fn=limit, timeout=300)


def test_validate_refuses_a_schema_file_of_dev_zero_in_one_line(tmp_path):
    r = _validate_bounded(str(_job_with_schema_file(tmp_path, "/dev/zero")))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines()[-1] == ("  task.questions.0.response_format: schema_file: cannot read /dev/zero: "
                                         "not a regular file (a FIFO, device or socket); give a file"), r.stderr


def test_validate_refuses_a_job_config_of_dev_zero_in_one_line():
    r = _validate_bounded("/dev/zero")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == ["vlbatch: cannot read job config /dev/zero: not a regular file (a FIFO, "
                                     "device or socket); give a file"], r.stderr


def test_job_config_that_is_a_fifo_or_too_large_is_refused(tmp_path):
    with _fifo_with_writer(tmp_path / "job.yaml", JOB.encode()) as fifo:
        assert _refused(fifo).startswith(f"cannot read job config {fifo}: not a regular file")
    big = tmp_path / "big.yaml"
    big.write_text(JOB + "# " + "x" * (1 << 20) + "\n")
    assert "over the 1 MiB limit of a job config" in _refused(big)


def test_checkpoint_config_json_that_is_a_fifo_is_refused_by_the_checkpoint_check(tmp_path):
    from vlbatch.pipeline.plan.checkpoint import check_model

    model = tmp_path / "model"
    model.mkdir()
    cfg = validate_config({"model": {"path": str(model)}, "input": {"uri": "/x.jsonl"}, "output": {"uri": "/o"}})
    with _fifo_with_writer(model / "config.json", b'{"model_type": "qwen3_5"}'), \
            pytest.raises(ConfigError) as err:
        check_model(cfg)
    assert f"model.path: {model} config.json: not a regular file (a FIFO, device or socket)" in str(err.value), \
        err.value


def test_fingerprint_refuses_a_checkpoint_file_over_its_cap_unread(tmp_path):
    from vlbatch.pipeline.plan.fingerprint import checkpoint_identity

    (tmp_path / "config.json").write_text("{}")
    with (tmp_path / "tokenizer.json").open("wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: its size alone refuses it
    with pytest.raises(ConfigError, match=r"^model.path: cannot read .*tokenizer.json: 67108865 bytes, over the "
                                          r"64 MiB limit of a checkpoint tokenizer or template file$"):
        checkpoint_identity(str(tmp_path))


def test_runtime_env_file_that_is_a_fifo_is_refused(tmp_path):
    from vlbatch.jobs.commands import _runtime_env_file
    from vlbatch.jobs.errors import SubmissionError

    with _fifo_with_writer(tmp_path / "env.yaml", b"pip: [x]\n") as fifo, \
            pytest.raises(SubmissionError, match=r"^--runtime-env: cannot read .*: not a regular file"):
        _runtime_env_file(str(fifo))


def test_fingerprint_reads_a_bounded_safetensors_header_whatever_it_claims(tmp_path):
    """A sparse 8 GiB model.safetensors whose header claims to be the whole file: the fingerprint reads at most
    `HEADER_MAX` of it (checked in a child under a 3 GB address-space limit: reading it all would fail there)."""
    import struct

    size = 8 << 30
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", size - 8))
        f.truncate(size)
    code = ("import sys; from vlbatch.pipeline.plan.fingerprint import checkpoint_identity; "
            "print(checkpoint_identity(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)))
    assert r.returncode == 0 and len(r.stdout.strip()) == 24, r.stderr[-2000:]


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja", "tokenizer.json"])
def test_the_cpu_stage_reads_checkpoint_files_through_the_same_checks(tmp_path, name):
    """What the stages read of a checkpoint after validate (the tokenizer here) is `read_named_file` too: a file
    swapped for a FIFO since validate is refused at once (the bundled checkpoint's tokenizer files, one a FIFO)."""
    import shutil

    from vlbatch.models import SHAPES_TINY
    from vlbatch.operators.preprocess.tokenizer import Tokenizer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if f != name:
            shutil.copy(SHAPES_TINY / f, ckpt / f)
    assert Tokenizer.from_dir(SHAPES_TINY).chat_template  # the real files load
    with _fifo_with_writer(ckpt / name, (SHAPES_TINY / name).read_bytes()), \
            pytest.raises(ConfigError, match=rf"^model.path: cannot read .*{name}: not a regular file"):
        Tokenizer.from_dir(ckpt)


def test_a_remote_named_file_is_capped_while_read(tmp_path):
    """An http(s) (or s3) named file goes through `read_bytes` with the kind's cap: a real local web server
    serving a 2 MiB file is refused naming the field; a small one is read."""
    import functools
    import http.server

    from vlbatch.operators.storage.named_file import SCHEMA_FILE, NamedFileError, read_named_file

    (tmp_path / "big.json").write_bytes(b" " * (2 << 20))
    (tmp_path / "ok.json").write_text('{"type": "object"}')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert read_named_file(f"{base}/ok.json", field="f", kind=SCHEMA_FILE) == b'{"type": "object"}'
        with pytest.raises(NamedFileError, match=rf"^f: cannot read {base}/big.json: 2097152 bytes is over the "
                                                 "schema file limit of 1048576$"):
            read_named_file(f"{base}/big.json", field="f", kind=SCHEMA_FILE)
    finally:
        server.shutdown()
        thread.join()
