"""Input sources: one `Source` per input format (the contract is `base.py`).

- `manifest.ManifestSource`: Parquet / JSONL / CSV manifests of media URIs (local, s3://, http(s)://)
  or of embedded media bytes (Parquet);
- `glob.GlobSource`: a glob of media files;
- `webdataset.WebDatasetSource`: WebDataset tar shards (local, s3://, http(s)://).
"""
from __future__ import annotations

from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.sources.base import COLUMNS, MANIFEST_SCHEMA, Source, task_pool

__all__ = ["COLUMNS", "MANIFEST_SCHEMA", "Source", "open_source", "task_pool"]


def open_source(cfg: JobConfig) -> Source:
    """The source of `cfg.input.format`."""
    if cfg.input.format == "glob":
        from vlbatch.pipeline.sources.glob import GlobSource

        return GlobSource(cfg)
    if cfg.input.format == "webdataset":
        from vlbatch.pipeline.sources.webdataset import WebDatasetSource

        return WebDatasetSource(cfg)
    from vlbatch.pipeline.sources.manifest import ManifestSource

    return ManifestSource(cfg)
