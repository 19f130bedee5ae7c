"""Where the model is on this node: its checkpoint (`local_model_path`) and its device (`resolve_device`),
for the CPU stage's processor, the model stage, the engine-rate probe and the backends (`pipeline/backends/`)."""
from __future__ import annotations

from vlbatch.pipeline.config import JobConfig


def local_model_path(cfg: JobConfig) -> str:
    """`model.path` on this node: itself when local, else downloaded once per node (s3://...)."""
    from vlbatch.operators.storage.checkpoint_cache import resolve_model_path

    return resolve_model_path(cfg.model.path, cfg.storage.options(), cfg.model.cache_dir)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
