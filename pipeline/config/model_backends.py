"""`MODEL_BACKENDS`: what runs the model in the model stage (`model.backend`; entry-point group
`vlbatch.model_backends` for out-of-tree ones). Under the config (as `formats.SOURCES`), apart from
`pipeline/backends/backends.py`, so the job config reads the table without importing the backends.

Each target is a backend class (the contract in `pipeline/backends/backends.py`'s docstring) called as
`target(cfg, on_finished=callback)`; its class attributes tell the model stage
`counts_finished` (it calls `on_finished(n)` as requests finish, else the stage counts rows per
call) and `compiled_kernels` (it runs our compiled CPU kernels: the SIMD width is set first).
A new backend: its class and one `Entry` below.
"""
from __future__ import annotations

from vlbatch.operators.registry import Entry, Registry

_PKG = "vlbatch.pipeline.backends.backends"

MODEL_BACKENDS = Registry("model backend", "model.backend", "engine", (
    Entry("engine", f"{_PKG}:EngineBackend",
          "our batch engine (paged KV, prefix and vision caches): the product"),
    Entry("transformers", f"{_PKG}:TransformersBackend",
          "transformers' generate(), one request at a time: the reference and benchmark baseline (slow)",
          check=f"{_PKG}:transformers_problem"),
), group="vlbatch.model_backends")
