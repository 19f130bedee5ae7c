"""The input formats (`input.format`): `SOURCES`, one `Entry` per `Source` class (`pipeline/sources/`).

The job config and its schema take their choices from it; `pipeline/sources.open_source` builds the
chosen one as `target(cfg, storage)`. Here, under the config, so the config never imports the sources (which
import the config): each entry names its class as "module:attr", imported only when chosen. A new
input format: its module (a `Source` subclass in `pipeline/sources/`) and one `Entry` below.
"""
from __future__ import annotations

from vlbatch.operators.registry import Entry, Registry

_MANIFEST = "vlbatch.pipeline.sources.manifest:ManifestSource"

SOURCES = Registry("input format", "input.format", "parquet", (
    Entry("parquet", _MANIFEST, "Parquet manifests of media URIs (local, s3://, http(s)://) or of embedded media "
                                "bytes (a binary column, or Hugging Face datasets' Image / Video structs)"),
    Entry("jsonl", _MANIFEST, "JSON Lines manifests of media URIs, read line by line (a bad line is one error row)"),
    Entry("csv", _MANIFEST, "CSV manifests of media URIs, with a header row"),
    Entry("glob", "vlbatch.pipeline.sources.glob:GlobSource",
          "`uri` is a glob of media files (or a folder, read recursively): one media per file"),
    Entry("webdataset", "vlbatch.pipeline.sources.webdataset:WebDatasetSource",
          "tar shards of samples; `uri` a glob or brace notation: shards/train-{000000..000127}.tar"),
), group="vlbatch.sources")
