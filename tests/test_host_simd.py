"""The SIMD width of the compiled CPU kernels, chosen per machine (operators/host_simd.py).

Real subprocesses and real compiles: the probe runs the engine's kernels at both widths, and a
fresh process that takes a cached choice compiles at that width (read off its machine code).
The suite runs with VLBATCH_SIMD=off (conftest); each test sets the mode it needs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vlbatch.operators import host_simd

AVX512 = "+avx512f" in host_simd.host_features().split(",")


def _python(code: str, **env: str) -> str:
    """Run `code` in a fresh interpreter (this one's environment + `env`) -> its last stdout line."""
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"} | env
    out = subprocess.run([sys.executable, "-c", code], env=full, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def auto(monkeypatch):
    monkeypatch.setenv("VLBATCH_SIMD", "auto")
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)


@pytest.fixture(scope="module")
def default_width() -> int:
    """LLVM's own width here, as a fresh process compiles."""
    return json.loads(_python("from vlbatch.operators.engine.simd_probe import compiled_width as w; "
                              "import json; print(json.dumps(w()))"))


@pytest.mark.slow
def test_probe_times_every_kernel_at_the_width_it_is_given(auto, default_width, tmp_path):
    if not AVX512:  # one width only: nothing to choose, and the choice says so
        assert host_simd.choose_simd(tmp_path / "simd.json").source == "one width"
        return
    other = 256 if default_width == 512 else 512
    run = host_simd._run_probe(other)
    assert run["width"] == other  # NUMBA_CPU_FEATURES reached the probe's code generator
    assert len(run["ms"]) == 10 and all(ms > 0 for ms in run["ms"].values())


@pytest.mark.slow
def test_probe_widths_keeps_the_default_unless_the_other_is_clearly_faster(auto, default_width):
    choice = host_simd.probe_widths(rounds=1)
    assert choice.default == default_width and set(choice.probe_ms) == {256, 512}
    other = 256 if default_width == 512 else 512
    faster = choice.probe_ms[other] < host_simd.MARGIN * choice.probe_ms[default_width]
    assert choice.width == (other if faster else default_width)
    assert "probe: 256-bit" in choice.describe()


def test_the_choice_is_probed_once_per_machine_and_cached(auto, monkeypatch, tmp_path):
    calls = []

    def fake_probe():  # the probe itself is the test above; here: who calls it, and what is kept
        calls.append(1)
        return host_simd.SimdChoice(256, 512, {256: 1.0, 512: 2.0}, "probed")

    monkeypatch.setattr(host_simd, "probe_widths", fake_probe)
    path = tmp_path / "simd.json"
    first, second = host_simd.choose_simd(path), host_simd.choose_simd(path)
    if not AVX512:
        assert first.source == second.source == "one width" and not calls
        return
    assert (first.source, second.source, len(calls)) == ("probed", "cached", 1)
    assert second.width == 256 and second.probe_ms == {256: 1.0, 512: 2.0}
    assert json.loads(path.read_text())[host_simd.machine_key()]["width"] == 256


@pytest.mark.slow
def test_a_fresh_process_compiles_at_the_cached_width(default_width, tmp_path):
    if not AVX512:  # one width only: the cached file is never read, numba's own width stays
        assert _python(f"from vlbatch.operators.host_simd import use_fastest_simd as u; "
                       f"print(u({str(tmp_path / 'simd.json')!r}).source)", VLBATCH_SIMD="auto") == "one width"
        return
    other = 256 if default_width == 512 else 512
    path = tmp_path / "simd.json"
    path.write_text(json.dumps({host_simd.machine_key(): {"width": other, "default": default_width,
                                                          "probe_ms": {"256": 1.0, "512": 1.0}}}))
    take = (f"from vlbatch.operators.host_simd import use_fastest_simd; c = use_fastest_simd({str(path)!r}); "
            "from vlbatch.operators.engine.simd_probe import compiled_width; print(compiled_width(), c.applied)")
    assert _python(take, VLBATCH_SIMD="auto") == f"{other} True"
    # too late: a module of ours that defines compiled kernels was imported first -> nothing changes
    late = "import vlbatch.operators.engine; " + take
    assert _python(late, VLBATCH_SIMD="auto") == f"{default_width} False"


def test_modes_and_a_users_own_features(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    monkeypatch.setenv("VLBATCH_SIMD", "off")
    assert host_simd.use_fastest_simd(tmp_path / "s.json") == host_simd.SimdChoice(None, source="off")
    monkeypatch.setenv("VLBATCH_SIMD", "512")
    assert host_simd.choose_simd(tmp_path / "s.json") == host_simd.SimdChoice(512, source="fixed")
    monkeypatch.setenv("VLBATCH_SIMD", "wide")
    with pytest.raises(ValueError, match="VLBATCH_SIMD='wide'"):
        host_simd.choose_simd(tmp_path / "s.json")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2")  # the user's own: left alone, nothing probed
    assert host_simd.use_fastest_simd(tmp_path / "s.json").source == "user"
    assert not (tmp_path / "s.json").exists()


@pytest.mark.slow
def test_the_model_actor_builds_its_kernels_at_the_chosen_width(default_width, tiny_ckpt, tmp_path):
    """The pipeline's model actor on the CPU: its module imported first (as Ray unpickles the actor
    class), then the actor built; its process compiles at the width VLBATCH_SIMD fixes."""
    if not AVX512:
        return  # one width: the actor's choice is numba's own (the test above)
    other = 256 if default_width == 512 else 512
    job = {"model": {"path": str(tiny_ckpt("dense")), "dtype": "float32", "device": "cpu"},
           "input": {"uri": str(tmp_path / "in.jsonl")}, "output": {"uri": str(tmp_path / "out")}}
    actor = ("from vlbatch.pipeline.stages.model_stage import ModelStage; "
             "from vlbatch.pipeline.config import validate_config; "
             f"stage = ModelStage(validate_config({job!r})); "
             "from vlbatch.operators.engine.simd_probe import compiled_width; print(compiled_width())")
    assert _python(actor, VLBATCH_SIMD=str(other)) == str(other)


def test_a_broken_cache_or_probe_leaves_numbas_width_and_never_fails(auto, monkeypatch, tmp_path):
    if not AVX512:
        return  # nothing is probed or cached: the tests above
    calls = []
    monkeypatch.setattr(host_simd, "probe_widths",
                        lambda: calls.append(1) or host_simd.SimdChoice(512, 512, {256: 2.0, 512: 1.0}))
    garbled = tmp_path / "simd.json"
    garbled.write_text("{not json")
    assert host_simd.choose_simd(garbled).width == 512 and len(calls) == 1  # probed over, then kept
    assert json.loads(garbled.read_text())[host_simd.machine_key()]["width"] == 512
    blocker = tmp_path / "file"
    blocker.write_text("")
    unwritable = host_simd.choose_simd(blocker / "simd.json")  # its folder is a file
    assert (unwritable.width, unwritable.source) == (None, "probe failed: FileExistsError")

    def failing():
        raise subprocess.CalledProcessError(1, "simd_probe")

    monkeypatch.setattr(host_simd, "probe_widths", failing)
    assert host_simd.use_fastest_simd(tmp_path / "other.json").source == "probe failed: CalledProcessError"
    assert "NUMBA_CPU_FEATURES" not in os.environ


@pytest.mark.parametrize("other_ms, taken", [(0.95, "default"), (0.85, "other")])
def test_the_rule_alternates_the_widths_and_needs_a_clear_margin(monkeypatch, other_ms, taken):
    """Fixed probe times (the real probe is the test above): the default width's best is 1.0 ms
    over its runs, the other's `other_ms`; the other is taken only below MARGIN (0.9) x 1.0."""
    order = []
    times = {None: [1.3, 1.0], 256: [other_ms + 0.4, other_ms]}  # None: the default run (512 here)

    def fake(width):
        order.append(width)
        key = None if width in (None, 512) else width
        return {"width": 512, "ms": {"k": times[key].pop(0)}}

    monkeypatch.setattr(host_simd, "_run_probe", fake)
    choice = host_simd.probe_widths(rounds=2)
    assert order == [None, 256, 512, 256]  # alternating, the default first
    assert choice.probe_ms == {512: 1.0, 256: other_ms}  # each width's best run
    assert (choice.width, choice.default) == ((512, 512) if taken == "default" else (256, 512))
