"""The Ray Data pipeline and the job config (the only package besides `jobs/` that imports ray).

Sub-packages in the order a run uses them (each imports only those after it: the `pipeline`
contract in pyproject.toml):
- `graph`: `run_job(plan) -> RunSummary`, the plan's stages as one Ray Data graph, manifest to committed output;
- `startup/`: the driver's start-up (`nothing_to_do`: the sink and its index read before Ray; where actors may
  start, `placement`; nodes lost mid-run, `node_loss`); `backends/`: the model backends (`backends`, `followers`);
- `stages/`: what runs in Ray actors and tasks (`decode`, `preprocess`, both fused `prepare`; `model_stage`,
  `write_stage`, `scan`), their rows (`rows`), the read + expansion (`expansion`, `requests`);
- `plan/`: the one plan (`spec`: `RunPlan`, its `StageSpec`s), the one preflight (`preflight`: `checks`,
  `checkpoint`, `fingerprint`, `fit` against the `cluster`), the run's sink (`sink`);
- `sources/`: the input sources (a `Source` per input format) and the kept columns (`keep`);
  `telemetry/`: the meter, progress, timeline and the run's summary;
- `config/`: the pydantic job config (`load_config`, `JobConfig`, the input formats, schema export);
  `demo`: the demo's inputs.
Importing this package imports nothing heavy.
"""
