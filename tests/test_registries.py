"""Extension points (operators/registry.py): each has one registry, and the job config's
choices, its validation messages and configs/job.schema.json come from it; a registered
implementation is all a new one needs; the kernels chosen in a job YAML reach the model."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vlbatch.operators import sink as sink_pkg
from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels import attention as attention_pkg
from vlbatch.operators.kernels import delta_rule as delta_rule_pkg
from vlbatch.operators.kernels import moe as moe_pkg
from vlbatch.operators.media import decoders as decoders_pkg
from vlbatch.operators.registry import Entry
from vlbatch.pipeline.config import SCHEMA_PATH, job_schema, load_config, validate_config
from vlbatch.pipeline.config import formats as formats_pkg
from vlbatch.pipeline.config import model_backends as model_backends_pkg

# (package, registry attribute, schema definition, property): every extension point
POINTS = [(attention_pkg, "ATTENTION", "EngineBudgets", "attention"),
          (delta_rule_pkg, "DELTA_RULE", "EngineBudgets", "delta_rule"),
          (moe_pkg, "MOE", "EngineBudgets", "moe"),
          (formats_pkg, "SOURCES", "InputSection", "format"),
          (sink_pkg, "SINKS", "OutputSection", "format"),
          (decoders_pkg, "DECODERS", "VideoSection", "decoder"),
          (model_backends_pkg, "MODEL_BACKENDS", "ModelSection", "backend")]
IDS = [p[1] for p in POINTS]


def _job(field: str, value: str) -> dict:
    """A minimal job dict with the dotted `field` set to `value`."""
    data = {"model": {"path": "/m"}, "input": {"uri": "/in/*.jpg"}, "output": {"uri": "/out"}}
    *parents, last = field.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def _value(cfg, field: str):
    for part in field.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize(("pkg", "attr", "definition", "prop"), POINTS, ids=IDS)
def test_the_configs_choices_and_the_schemas_enum_are_the_registrys(pkg, attr, definition, prop):
    reg = getattr(pkg, attr)
    for name in reg.choices():  # every registered name is accepted, at the field the registry names
        assert _value(validate_config(_job(reg.field, name)), reg.field) == name
    assert _value(validate_config(_job("model.path", "/m")), reg.field) == reg.default  # and the default
    for schema in (job_schema(), json.loads(SCHEMA_PATH.read_text())):  # generated now, and the file on disk
        assert schema["$defs"][definition]["properties"][prop]["enum"] == list(reg.choices())


@pytest.mark.parametrize(("pkg", "attr", "definition", "prop"), POINTS, ids=IDS)
def test_an_unknown_choice_names_the_field_and_lists_the_choices(pkg, attr, definition, prop):
    reg = getattr(pkg, attr)
    with pytest.raises(ConfigError) as e:
        validate_config(_job(reg.field, "no-such-impl"))
    assert f"{reg.field}: unknown {reg.kind} 'no-such-impl'; allowed: {', '.join(reg.choices())}" in str(e.value)
    with pytest.raises(ConfigError, match=f"^{reg.field}: unknown .*allowed: {', '.join(reg.choices())}$"):
        reg.load("no-such-impl")  # the same words where code chooses by name


def test_reading_the_registries_imports_no_backend():
    """The config (and so `vlbatch validate`) reads every registry without torch, Ray or pyarrow:
    an implementation's module is imported only when it is chosen."""
    probe = ("import sys\nfrom vlbatch.pipeline.config import job_schema, validate_config\n"
             "job_schema()\nvalidate_config({'model': {'path': '/m', 'engine': {'attention': 'triton', "
             "'delta_rule': 'fla', 'moe': 'grouped_mm'}}, 'input': {'uri': '/i'}, 'output': {'uri': '/o'}})\n"
             "print(sorted(m for m in ('torch', 'ray', 'pyarrow', 'triton', 'fla') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


COUNTING = '''
from vlbatch.operators.kernels.attention.naive import NaivePagedAttention


class CountingAttention(NaivePagedAttention):
    """A new attention kernel: the naive one, counting its calls."""

    name = "counting"

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)
'''


def test_a_new_attention_kernel_is_its_module_and_one_entry(tmp_path, monkeypatch, tiny_ckpt):
    """The kernel's module (here written by the test) and its `Entry`: the config accepts and
    documents it, and an engine built from that config runs its steps through it."""
    from test_engine_support import image, request

    from vlbatch.pipeline.backends.backends import EngineBackend

    (tmp_path / "counting_attention.py").write_text(textwrap.dedent(COUNTING))
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = Entry("counting", "counting_attention:CountingAttention.create", "counts its calls (a test)")
    ckpt = tiny_ckpt("dense")
    data = {"model": {"path": str(ckpt), "dtype": "float32", "device": "cpu", "engine": {"attention": "counting"}},
            "input": {"uri": str(tmp_path / "*.jpg"), "format": "glob"}, "output": {"uri": str(tmp_path / "out")}}
    with monkeypatch.context() as m:
        m.setattr(attention_pkg, "ATTENTION", attention_pkg.ATTENTION.with_entry(entry))  # the registration
        cfg = validate_config(data)
        assert "counting" in job_schema()["$defs"]["EngineBudgets"]["properties"]["attention"]["enum"]
        engine = EngineBackend(cfg).engine
        assert type(engine.runner.attention).__name__ == "CountingAttention"
        [result] = engine.generate([request(ckpt, "r0", ["Describe.", ("image", image(0))], max_new_tokens=3)])
        assert result.finish_reason in ("stop", "length") and engine.runner.attention.calls > 0
    with pytest.raises(ConfigError, match="allowed: auto, sdpa, cpu, triton, naive$"):  # removed again
        validate_config(data)


def test_a_new_sink_is_its_module_and_one_entry(tmp_path, monkeypatch):
    from vlbatch.pipeline.plan.sink import open_sink

    (tmp_path / "other_sink.py").write_text("from vlbatch.operators.sink.parquet import ParquetSink\n\n\n"
                                            "class OtherSink(ParquetSink):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sink_pkg, "SINKS", sink_pkg.SINKS.with_entry(Entry("other", "other_sink:OtherSink", "a test")))
    cfg = validate_config({"model": {"path": "/m"}, "input": {"uri": "/in/*.jpg", "format": "glob"},
                           "output": {"uri": str(tmp_path / "out"), "format": "other"}})
    sink = open_sink(cfg, str(tmp_path / "out" / "run"))
    assert type(sink).__name__ == "OtherSink" and sink.uri.endswith("run")


def _kernels(engine):
    from vlbatch.operators.model.deltanet import GatedDeltaNet
    from vlbatch.operators.model.moe import Experts

    mods = list(engine.model.language_model.modules())
    delta = {type(m.kernels).__name__ for m in mods if isinstance(m, GatedDeltaNet)}
    moe = {type(m.kernel).__name__ for m in mods if isinstance(m, Experts)}
    return type(engine.runner.attention).__name__, delta, moe


def test_the_kernels_a_job_yaml_chooses_reach_the_model(tmp_path, tiny_ckpt):
    """model.engine.attention / delta_rule / moe in the YAML -> the pipeline's engine backend ->
    the runner's attention, every DeltaNet layer's rule, every MoE layer's experts; the naive
    kernels answer as the defaults do (greedy tokens equal)."""
    from test_engine_support import image, request

    from vlbatch.pipeline.backends.backends import EngineBackend

    ckpt = tiny_ckpt("moe")
    job = Path(tmp_path / "job.yaml")
    job.write_text(textwrap.dedent(f"""\
        model:
          path: {ckpt}
          dtype: float32
          device: cpu
          engine: {{attention: naive, delta_rule: naive, moe: loop}}
        input: {{uri: media/*.jpg, format: glob}}
        output: {{uri: out, format: parquet}}
        """))
    chosen = EngineBackend(load_config(job)).engine
    assert _kernels(chosen) == ("NaivePagedAttention", {"NaiveDeltaRule"}, {"LoopExperts"})
    default = EngineBackend(load_config(job, ["model.engine={}"])).engine
    assert _kernels(default) == ("CpuPagedAttention", {"TorchDeltaRule"}, {"GroupedMMExperts"})
    req = request(ckpt, "r0", ["Describe.", ("image", image(1))], max_new_tokens=4)
    [a], [b] = chosen.generate([req]), default.generate([req])
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_a_backend_that_is_not_installed_is_a_setup_error_naming_the_field():
    from vlbatch.operators.errors import SetupError

    reg = moe_pkg.MOE.with_entry(Entry("absent", "vlbatch_no_such_backend.kernels:Experts.create", "not installed"))
    assert reg.choices()[-1] == "absent" and moe_pkg.MOE.choices()[-1] == "loop"  # a new registry; the old unchanged
    with pytest.raises(SetupError, match=r"^model.engine.moe=absent: vlbatch_no_such_backend is not installed here"):
        reg.load("absent")
