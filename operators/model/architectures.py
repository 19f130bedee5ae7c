"""`ARCHITECTURES`: config.json's `model_type` -> the model family vlbatch implements for it (as
vLLM's model registry maps architectures to model classes). Each target is an `Architecture`:
how `config.py` reads that family's config.json (`moe`: routed experts in the decoder) and the
model class built from the parsed `ModelConfig` (imported only when built: reading the table
imports no torch). Entry-point group `vlbatch.architectures` for out-of-tree families. A new
family: its model module, an `Architecture` and one `Entry` below.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from vlbatch.operators.registry import Entry, Registry


@dataclass(frozen=True)
class Architecture:
    """One model family: `moe` (its text config has routed experts) and `model` ("module:Class",
    a class called as `Class(config: ModelConfig)`)."""

    moe: bool
    model: str

    def model_class(self) -> type:
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)


def build_model(config):
    """The model of `config`'s family (`config.model_type`), built from it (on the current torch device)."""
    return ARCHITECTURES.load(config.model_type).model_class()(config)


_MODEL = "vlbatch.operators.model.model:Qwen35Model"
QWEN3_5 = Architecture(moe=False, model=_MODEL)
QWEN3_5_MOE = Architecture(moe=True, model=_MODEL)

_PKG = "vlbatch.operators.model.architectures"

ARCHITECTURES = Registry("model architecture", "config.json model_type", "qwen3_5", (
    Entry("qwen3_5", f"{_PKG}:QWEN3_5", "Qwen3.5 dense (transformers' qwen3_5)"),
    Entry("qwen3_5_moe", f"{_PKG}:QWEN3_5_MOE", "Qwen3.5 MoE (transformers' qwen3_5_moe)"),
), group="vlbatch.architectures")
