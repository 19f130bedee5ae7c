"""Input sources: one `Source` per input format (the contract is `base.py`).

`SOURCES` (`pipeline/config/formats.py`, under the config: the config never imports this package)
names them; `open_source` builds the chosen one as `target(cfg, storage)`. Importing this package imports
no Ray: a source's module is imported when chosen. A new input format: its module (a `Source`
subclass) and one `Entry` in `SOURCES`.
"""
from __future__ import annotations

from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.config.formats import SOURCES

__all__ = ["open_source"]


def open_source(cfg: JobConfig, storage=None):
    """The `base.Source` of `cfg`'s `input.format` (`storage`: the run's `StorageOptions`, None: from `cfg`)."""
    return SOURCES.load(cfg.input.format)(cfg, storage)
