"""Input paths (issue 33): `--set` paths resolve against the current directory before the run id
is derived (the same job resumes from another directory), and a plain folder as `input.uri`
with `input.format: glob` reads the folder's media."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlbatch.operators.errors import ConfigError
from vlbatch.pipeline.config import load_config
from vlbatch.pipeline.plan.checks import check_paths

CONFIG = """model: {path: ../model}
input: {uri: ../media/*, format: glob}
output: {uri: ../out, run_id: null}
"""


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "job.yaml").write_text(CONFIG)
    media = tmp_path / "data" / "media"
    (media / "cats").mkdir(parents=True)
    (media / "_tmp").mkdir()
    for p in (media / "a.png", media / "cats" / "b.JPG", media / "_tmp" / "staged.png", media / ".hidden.png"):
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(p, format="PNG")
    (media / "manifest.jsonl").write_text('{"media_uri": "a.png"}\n')
    (media / "notes.txt").write_text("not media")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run_id(cfg: Path, *overrides: str) -> tuple[str, str]:
    c = load_config(cfg, list(overrides))
    return c.input.uri, c.resolved_run_id()


def test_set_paths_are_absolute_before_the_run_id_so_another_cwd_resumes(tree, monkeypatch):
    cfg = tree / "cfg" / "job.yaml"
    monkeypatch.chdir(tree / "data")
    uri, rid = _run_id(cfg, "input.uri=media/*", "output.uri=out")
    assert uri == str(tree / "data" / "media" / "*")
    assert load_config(cfg, ["output.uri=out"]).output.uri == str(tree / "data" / "out")
    monkeypatch.chdir(tree)  # the same job from the folder above
    assert _run_id(cfg, "input.uri=data/media/*", "output.uri=data/out") == (uri, rid)
    monkeypatch.chdir(tree / "cfg")
    assert _run_id(cfg, f"input.uri={tree}/data/media/*", f"output.uri={tree}/data/out") == (uri, rid)
    # a whole section given by --set: its paths too
    assert load_config(cfg, ["input={uri: x, format: glob}"]).input.uri == str(tree / "cfg" / "x")
    # the config file's own relative paths stay relative to the file's folder
    assert load_config(cfg).input.uri == str(tree / "media" / "*")


def test_a_plain_folder_as_glob_input_reads_its_media(tree, tiny_ckpt):
    from vlbatch.pipeline.sources.glob import GlobSource

    folder = tree / "data" / "media"
    model = f"model.path={tiny_ckpt('dense')}"
    cfg = load_config(tree / "cfg" / "job.yaml", [f"input.uri={folder}", model])
    check_paths(cfg)  # validate: the folder holds media
    assert GlobSource(cfg)._uris == [str(folder / "a.png"), str(folder / "cats" / "b.JPG")]
    with_slash = load_config(tree / "cfg" / "job.yaml", [f"input.uri={folder}/"])
    assert GlobSource(with_slash)._uris == [str(folder / "a.png"), str(folder / "cats" / "b.JPG")]

    empty = tree / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    bad = load_config(tree / "cfg" / "job.yaml", [f"input.uri={empty}", model])
    with pytest.raises(ConfigError, match=r"input.uri: .*holds no image or video files"):
        check_paths(bad)
    with pytest.raises(ConfigError, match=r"input.uri: .*holds no image or video files"):
        GlobSource(bad).count()  # lists the folder
    assert os.path.isdir(empty)
