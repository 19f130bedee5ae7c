"""Start-up checks of a validated job config against the disk: `check_paths(config)` (the first step of
`plan/preflight.py`; the output's, `check_output`, is `plan/fingerprint.py`'s).

Also that the chosen implementations (`video.decoder`, `model.backend`, ...: each registry entry's
check, e.g. TorchCodec needs FFmpeg's shared libraries; a plugin must import) and `video.decode_device`
(GPU decode needs CUDA) can run on this machine: one line naming what to install.

Run by `vlbatch run` and `vlbatch validate` before Ray starts (not by `submit`, whose paths
are the cluster's). Local paths only: the model folder holds config.json, *.safetensors and
tokenizer.json (the whole checkpoint: `pipeline/plan/checkpoint.py`), the input matches at least one
file, and a local output.uri is (or can become) a folder. s3:// and other remote URIs are left
to run time (checking them needs the storage settings and the network; a remote `model.path`
is downloaded by each node: `operators/storage/checkpoint_cache.py`). The output bucket is
checked by `plan/fingerprint.check_output` (needs the storage settings: s3:// only).
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.storage.options import is_local
from vlbatch.pipeline.config import JobConfig

MODEL_FILES = ("config.json", "*.safetensors", "tokenizer.json")


def _model_problem(path: str) -> str | None:
    p = Path(path.removeprefix("file://"))
    if not p.exists():
        return f"{path} does not exist"
    if not p.is_dir():
        return f"{path} is not a directory (expected a checkpoint folder in the Hugging Face layout)"
    missing = [m for m in MODEL_FILES if not any(p.glob(m))]
    if missing:
        return f"{path} has no {', '.join(missing)} (expected a checkpoint folder in the Hugging Face layout)"
    return None


def _input_problem(uri: str, fmt: str) -> str | None:
    path = uri.removeprefix("file://")
    if fmt == "webdataset":
        from vlbatch.pipeline.sources.webdataset import expand_braces

        shards = [m for p in expand_braces(path) for m in glob.glob(p)]
        return None if any(os.path.isfile(m) for m in shards) else f"{uri!r} matches no shards"
    if fmt == "glob" and os.path.isdir(path):  # a plain folder: its media (sources/glob.py)
        from vlbatch.operators.media.load import folder_media

        found = (os.path.join(d, f) for d, _, files in os.walk(path) for f in files)
        return None if folder_media(path, found) else f"the folder {uri!r} holds no image or video files"
    if fmt == "glob" or glob.has_magic(path):
        if not any(os.path.isfile(m) for m in glob.iglob(path, recursive=True)):
            return f"the glob {uri!r} matches no files"
        return None
    if os.path.isdir(path):
        if not any(e.is_file() and not e.name.startswith((".", "_")) for e in os.scandir(path)):
            return f"{uri} is an empty folder (no manifest files)"
        return None
    return None if os.path.isfile(path) else f"{uri} does not exist"


def _choice_problems(config: JobConfig) -> list[str]:
    """The chosen implementations (video decoder, model backend, sink, ...: `choices.choice_problems`,
    from each registry's checks; a broken plugin) and the decode device can run on this machine:
    one line each if not."""
    from vlbatch.pipeline.config.choices import choice_problems

    v, problems = config.video, choice_problems(config)
    if v.decode_device != "cpu":
        from vlbatch.operators.media.gpu_decode import decode_device_problem

        if why := decode_device_problem(v.decode_device, config.model.device):
            problems.append(f"video.decode_device: {why}")
    return problems


def _output_problem(uri: str, run_id: str) -> str | None:
    """A local output folder (and the run's folder in it) must be a folder or not exist yet; its
    nearest existing parent must be a folder too (a file there is a `mkdir` error deep in a writer)."""
    root = Path(uri.removeprefix("file://"))
    for p in (root, root / run_id):
        if p.exists() and not p.is_dir():
            return f"{p} is a file, not a folder (the run writes <output.uri>/<run_id>/part-*.parquet)"
    parent = root
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder, so {uri} cannot be created"
    return None


def check_paths(config: JobConfig, run_id: str | None = None) -> None:
    """Local `model.path` and `input.uri` exist and hold what the run reads, else one
    ConfigError naming each bad field; remote URIs (s3://...) are left to run time. `run_id`: the
    preflight's (None: the config's)."""
    problems = []
    if is_local(config.model.path) and (why := _model_problem(config.model.path)):
        problems.append(f"model.path: {why}")
    if is_local(config.input.uri) and (why := _input_problem(config.input.uri, config.input.format)):
        problems.append(f"input.uri: {why}")
    problems += _choice_problems(config)
    run_id = config.resolved_run_id() if run_id is None else run_id
    if is_local(config.output.uri) and (why := _output_problem(config.output.uri, run_id)):
        problems.append(f"output.uri: {why}")
    if problems:
        raise ConfigError("invalid job config:\n  " + "\n  ".join(problems))
