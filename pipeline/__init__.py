"""The Ray Data pipeline and the job config (the only package besides `jobs/` that imports ray).

- `config`: the pydantic job config (`load_config`, `JobConfig`, schema export);
- `runner`: `run_job(config) -> RunSummary`, the graph from manifest to committed Parquet;
- `sources`: the input sources (a `Source` per input format: manifests, globs); `requests`: expanding
  manifest rows into requests with stable ids;
- `rows`: typed row schemas of the stages (frozen dataclasses <-> Arrow);
- `stages` (decode, preprocess, or both fused), `model_stage` + `backends` (engine), `write_stage`;
- `progress`: terminal / log progress and the summary's rates; `demo`: the demo's inputs.
Importing this package imports nothing heavy.
"""
