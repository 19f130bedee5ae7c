"""Checkpoints bundled with vlbatch (data only; nothing here is imported at run time by the pipeline).

`SHAPES_TINY`: the demo's default model, a tiny Qwen3.5 (vision tower, three Gated
DeltaNet layers and one full-attention layer) trained on synthetic shape scenes by
`python -m vlbatch.devtools.training.shapes` (scripts/devtools/training/README.md has the chain of runs).
"""
from pathlib import Path

SHAPES_TINY = Path(__file__).resolve().parent / "shapes-tiny"
