"""Shared fixtures: tiny checkpoints in the real Hugging Face layout, built once per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """`tiny_ckpt(variant, shards=1)` -> Path of a tiny random checkpoint (cached per session)."""
    from operators.checkpoints import make_tiny_checkpoint

    cache: dict = {}

    def get(variant: str = "dense", shards: int = 1):
        key = (variant, shards)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{variant}_{shards}")
            cache[key] = make_tiny_checkpoint(out, variant, shards=shards)
        return cache[key]

    return get
