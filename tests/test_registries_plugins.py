"""Out-of-tree plugins (issue 49): a package that declares entry points in the groups
`vlbatch.<point>` (`vlbatch.decoders`, `vlbatch.model_backends`, `vlbatch.sinks`, ...) adds a
video decoder, a model backend and a sink without any vlbatch file changed. The "package"
here is a tmp folder put on the path: a `*.dist-info/entry_points.txt` and its module, as pip
would install it. The registries list the plugin's entries in the config's choices, the JSON
schema, `vlbatch validate`'s output, and a real `vlbatch run` (its own local Ray, the tiny
checkpoint) uses all three. A broken plugin is one ConfigError naming it."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from vlbatch.operators.errors import ConfigError

PLUGIN = '''
import dataclasses
import os
from pathlib import Path

from vlbatch.operators.engine.request import Result
from vlbatch.operators.media.decoders.pyav_backend import PyAVDecoder
from vlbatch.operators.sink.parquet import ParquetSink
from vlbatch.pipeline.backends.backends import EngineBackend

MARKS = Path({marks!r})


class FakeDecoder(PyAVDecoder):
    """PyAV, marking each video it opens (a decoder added by a plugin)."""

    name = "fake"

    def open(self, data):
        (MARKS / f"decoder-{{os.getpid()}}").touch()
        return super().open(data)


class TaggedBackend(EngineBackend):
    """The engine backend, each answer tagged (a model backend added by a plugin)."""

    def generate(self, rows):
        out = super().generate(rows)
        return {{k: dataclasses.replace(v, text="[tagged] " + v.text) if isinstance(v, Result) else v
                for k, v in out.items()}}


class MarkerSink(ParquetSink):
    """Parquet, marking each commit (a sink added by a plugin)."""

    def commit(self, table):
        (MARKS / f"sink-{{os.getpid()}}").touch()
        return super().commit(table)
'''

ENTRY_POINTS = """\
[vlbatch.decoders]
fake = fake_plugin:FakeDecoder

[vlbatch.model_backends]
tagged = fake_plugin:TaggedBackend

[vlbatch.sinks]
marker = fake_plugin:MarkerSink
"""


def _package(root: Path, dist: str, entry_points: str, modules: dict[str, str]) -> Path:
    """An installed-looking package in `root`: `<dist>-1.0.dist-info` (METADATA, entry_points.txt)
    and its modules -> `root` (to put on the path)."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    for name, text in modules.items():
        (root / f"{name}.py").write_text(text)
    return root


@pytest.fixture()
def plugin(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    root = _package(tmp_path / "site", "vlbatch-fake-plugin", ENTRY_POINTS,
                    {"fake_plugin": textwrap.dedent(PLUGIN.format(marks=str(marks)))})
    return root, marks


def _add_video(workdir: Path) -> Path:
    """One video line appended to the job's manifest (the decoder's work)."""
    from vlbatch.devtools.samples import encode_video

    path = workdir / "media" / "clip.mp4"
    encode_video(path, 12, 64, 48, 4)
    with open(workdir / "manifest.jsonl", "a") as f:
        f.write(json.dumps({"media_uri": str(path), "media_type": "video"}) + "\n")
    return path


@pytest.mark.ray
def test_a_plugin_adds_a_decoder_a_model_backend_and_a_sink(tmp_path, plugin, tiny_ckpt, monkeypatch):
    from test_jobs_support import read_output, vlbatch, write_job

    from vlbatch.pipeline.config import job_schema, load_config

    root, marks = plugin
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2, write_batch=2,
                    extra="video: {decoder: fake, fps: 2.0, max_pixels: 12544}\n")
    text = cfg.read_text().replace("device: cpu}", "device: cpu, backend: tagged}")
    cfg.write_text(text.replace("output: {uri: ", "output: {format: marker, uri: "))
    video = _add_video(tmp_path / "wd")

    monkeypatch.syspath_prepend(str(root))  # this process sees the plugin as installed
    defs = job_schema()["$defs"]
    assert "fake" in defs["VideoSection"]["properties"]["decoder"]["enum"]
    assert "tagged" in defs["ModelSection"]["properties"]["backend"]["enum"]
    assert "marker" in defs["OutputSection"]["properties"]["format"]["enum"]
    loaded = load_config(str(cfg))
    assert (loaded.video.decoder, loaded.model.backend, loaded.output.format) == ("fake", "tagged", "marker")

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    checked = vlbatch("validate", str(cfg), env=env, timeout=300)
    assert checked.returncode == 0, (checked.stdout + checked.stderr)[-3000:]
    for line in ("video.decoder=fake (plugin vlbatch-fake-plugin)",
                 "model.backend=tagged (plugin vlbatch-fake-plugin)",
                 "output.format=marker (plugin vlbatch-fake-plugin)"):
        assert line in checked.stdout, checked.stdout

    # its own local Ray: the plugin is installed in this run's environment only (PYTHONPATH), which the workers
    # of a Ray started before it (the session's) do not have, as on a cluster whose nodes lack the plugin
    run = vlbatch("run", str(cfg), "--no-lock", env=env, cwd=tmp_path, timeout=400, local_ray=True)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    last = run.stdout.splitlines()[-1]
    assert "done: 3 ok, 0 error, 0 skipped" in last, last
    rows = read_output(Path(last.split(" -> ", 1)[1].split("/ in ", 1)[0]))
    assert len(rows) == 3, rows
    assert all(r["status"] == "ok" and r["answer"].startswith("[tagged] ") for r in rows), rows
    assert str(video) in {r["media_uri"] for r in rows}
    made = {p.name.split("-")[0] for p in marks.iterdir()}
    assert made == {"decoder", "sink"}, made  # the plugin's decoder decoded the video, its sink committed


BROKEN = """\
[vlbatch.decoders]
broken = no_such_module_here:Decoder
"""


def test_a_broken_plugin_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """Listed by name without importing it (entry points are read when a registry is read, not at
    import); chosen, the import error is one ConfigError naming the field, the plugin and its package."""
    from vlbatch.operators.media import decoders
    from vlbatch.pipeline.config import validate_config
    from vlbatch.pipeline.plan.checks import check_paths

    root = _package(tmp_path / "site", "vlbatch-broken", BROKEN, {})
    monkeypatch.syspath_prepend(str(root))
    assert "broken" in decoders.DECODERS.choices()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jpg").write_bytes(b"x")
    config = validate_config({"model": {"path": str(tmp_path)},
                              "input": {"uri": str(tmp_path / "in" / "*.jpg"), "format": "glob"},
                              "output": {"uri": str(tmp_path / "out")}, "video": {"decoder": "broken"}})
    with pytest.raises(ConfigError) as e:
        check_paths(config)
    assert ("video.decoder: the plugin 'broken' (entry point vlbatch.decoders, package vlbatch-broken) "
            "cannot be loaded: ModuleNotFoundError") in str(e.value)
    with pytest.raises(ConfigError, match="plugin 'broken' .*package vlbatch-broken"):
        decoders.get_decoder("broken")


ARCH = """\
[vlbatch.architectures]
qwen3_5_renamed = arch_plugin:RENAMED

[vlbatch.prefix_caches]
counted = arch_plugin:CountedPrefixCache
"""

ARCH_MODULE = '''
from vlbatch.operators.engine.caches.prefix_cache_naive import DictPrefixCache
from vlbatch.operators.model.architectures import Architecture
from vlbatch.operators.model.model import Qwen35Model


class RenamedModel(Qwen35Model):
    """Qwen3.5 dense under another model_type (a model family added by a plugin)."""


RENAMED = Architecture(moe=False, model="arch_plugin:RenamedModel")


class CountedPrefixCache(DictPrefixCache):
    """The dict store under another name (a prefix cache added by a plugin)."""
'''


def test_a_plugin_adds_a_model_architecture_and_a_prefix_cache(tmp_path, tiny_ckpt, monkeypatch):
    """config.json's model_type and `EngineConfig.prefix_cache` read their registries too: a
    checkpoint of a model_type only a plugin knows loads into the plugin's model class, and an
    engine keeps its prefixes in the plugin's store. (Our loader only: transformers' processor
    classes, which the engine's tokenizer comes from, know no such model_type.)"""
    import shutil

    from test_engine_support import image, request

    from vlbatch.operators.factory import load_engine
    from vlbatch.operators.model.loader import load_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("dense"), ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3_5_renamed"}))
    with pytest.raises(ConfigError, match="model_type must be one of .*'qwen3_5_moe'.*got 'qwen3_5_renamed'"):
        load_model(str(ckpt))  # not installed yet
    monkeypatch.syspath_prepend(str(_package(tmp_path / "site", "vlbatch-arch-plugin", ARCH,
                                             {"arch_plugin": ARCH_MODULE})))
    model = load_model(str(ckpt))
    assert type(model).__name__ == "RenamedModel" and model.config.model_type == "qwen3_5_renamed"
    engine = load_engine(str(tiny_ckpt("dense")), prefix_cache="counted")
    assert type(engine.prefix_cache).__name__ == "CountedPrefixCache"
    [result] = engine.generate([request(tiny_ckpt("dense"), "r0", ["Describe.", ("image", image(0))],
                                        max_new_tokens=3)])
    assert result.finish_reason in ("stop", "length")


def test_a_plugin_that_takes_a_taken_name_is_refused(tmp_path, monkeypatch):
    """A plugin named as one of vlbatch's own decoders: the table refuses it when read, naming it."""
    from vlbatch.operators.media import decoders

    monkeypatch.syspath_prepend(str(_package(tmp_path / "site", "vlbatch-clash", "[vlbatch.decoders]\n"
                                             "pyav = clash:Decoder\n", {})))
    with pytest.raises(ConfigError, match="^video.decoder: the plugin 'pyav' .*package vlbatch-clash.* takes the "
                                          "name of vlbatch's own video decoder"):
        decoders.DECODERS.choices()
