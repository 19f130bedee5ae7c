"""The run's sink (`open_sink`): opened by the driver at start-up (`startup/nothing_to_do.py`, the graph, a stop)
and by each write actor (`stages/write_stage.py`), so it sits below both."""
from __future__ import annotations

import pyarrow as pa

from vlbatch.operators.sink import new_sink
from vlbatch.operators.sink.base import Sink
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.sources.keep import output_schema


def keep_schema(cfg: JobConfig) -> pa.Schema | None:
    """The run's schema of `input.columns.keep` (from the input's schema; None: nothing kept)."""
    if not cfg.input.columns.keep:
        return None
    from vlbatch.pipeline.sources import open_source

    return open_source(cfg).keep_schema()


def open_sink(cfg: JobConfig, run_uri: str, storage=None, source=None) -> Sink:
    """The sink of one run (`run_uri` = `<output.uri>/<run_id>`): the `output.format` entry of
    `operators/sink.SINKS`. Its schema: `OUTPUT_SCHEMA` plus the kept input columns (of `source`, the run's
    `Source`: its schema read once; None: the input opened again). `storage`: the run's (None: the config's)."""
    storage = cfg.storage.options() if storage is None else storage
    keep = keep_schema(cfg) if source is None else (source.keep_schema() if cfg.input.columns.keep else None)
    return new_sink(cfg.output.format, run_uri, storage, output_schema(keep))
