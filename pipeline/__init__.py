"""The Ray Data pipeline and the job config (the only package besides `jobs/` that imports ray).

Sub-packages in the order a run uses them (each imports only those after it: the `pipeline`
contract in pyproject.toml):
- `graph`: `run_job(plan) -> RunSummary`, the plan's stages as one Ray Data graph, manifest to committed output;
- `stages/`: the Ray Data stage classes (`cpu` decode / preprocess / both fused, `model_stage` + `backends`
  + `replica`, `write_stage`, `scan`), their rows (`rows`), the read + expansion (`expansion`, `requests`),
  where actors may start (`placement`);
- `plan/`: the one plan (`spec`: `RunPlan`, its `StageSpec`s), the one preflight (`preflight`: `checks`,
  `checkpoint`, `fingerprint`, `fit` against the `cluster`);
- `sources/`: the input sources (a `Source` per input format) and the kept columns (`keep`);
  `telemetry/`: the meter, progress, timeline and the run's summary;
- `config/`: the pydantic job config (`load_config`, `JobConfig`, the input formats, schema export);
  `demo`: the demo's inputs.
Importing this package imports nothing heavy.
"""
