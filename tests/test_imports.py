"""Import structure: the direction media -> preprocess, no cycles between module pairs, no private Ray API.

Reads the source (every import statement, function-level ones included), so a lazy import
cannot hide a dependency."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"operators": "vlbatch.operators", "pipeline": "vlbatch.pipeline", "jobs": "vlbatch.jobs"}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _module(rel: str) -> Path:
    return ROOT / rel


def test_media_imports_nothing_from_preprocess():
    files = sorted((ROOT / "operators" / "media").rglob("*.py"))
    assert len(files) >= 8  # image.py, sampling.py, load.py, video.py, ... really scanned
    bad = {str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if m.startswith("vlbatch.operators.preprocess"))
           for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_preprocess_keeps_the_documented_imports():
    import vlbatch.operators.preprocess as pp
    from vlbatch.operators.media.image import load_image
    from vlbatch.operators.media.sampling import group_timestamps, sample_frame_indices
    from vlbatch.operators.preprocess.processor import Processor

    assert (pp.load_image, pp.sample_frame_indices, pp.group_timestamps, pp.Processor) == \
        (load_image, sample_frame_indices, group_timestamps, Processor)  # the README's import keeps working


def test_no_cycles_between_module_pairs():
    pairs = [("pipeline/backends/backends.py", "vlbatch.pipeline.stages.model_place",  # the backends' link to the stages
              "pipeline/stages/model_place.py", "vlbatch.pipeline.backends.backends"),
             ("operators/engine/request.py", "vlbatch.operators.engine.media_spans",
              "operators/engine/media_spans.py", "vlbatch.operators.engine.request")]
    for a, a_name, b, b_name in pairs:
        a_imports_b = any(m.startswith(a_name) for m in _imports(_module(a)))
        b_imports_a = any(m.startswith(b_name) for m in _imports(_module(b)))
        assert not (a_imports_b and b_imports_a), (a, b)
        assert a_imports_b or b_imports_a, (a, b)  # the dependency still exists, in one direction


@pytest.mark.slow
def test_no_private_ray_api():
    offenders = {}
    for folder in PACKAGES:
        for f in (ROOT / folder).rglob("*.py"):
            bad = sorted(m for m in _imports(f) if m.startswith("ray") and "._" in m)
            if bad:
                offenders[str(f.relative_to(ROOT))] = bad
    assert offenders == {}
