"""The job config: the one user-facing boundary of the pipeline (pydantic v2).

A job is a YAML file (``configs/*.yaml``) plus ``--set a.b=value`` overrides. It is
validated completely before Ray starts; every problem becomes one
`vlbatch.operators.errors.ConfigError` whose message names each bad field (dotted path) and,
for choices, the allowed values. Everything past this package uses the frozen `JobConfig`
object (pydantic models with ``frozen=True``), never raw dicts.

- `schema.py`: the sections and `JobConfig` (fields, defaults, cross-field rules, the run id); `resources.py`
  the `resources` section; `types.py` the number types every number field is (strict, floats finite);
- `load.py`: `load_config(path, overrides)` (YAML, overrides, relative paths), `validate_config`
  (dict -> `JobConfig` or one `ConfigError`), `export_schema` (``configs/job.schema.json``:
  ``python -m vlbatch.pipeline.config --schema``).

`vlbatch.pipeline.plan.checks.check_paths(config)` (run by `vlbatch run` and `vlbatch validate` before
Ray starts; not by `submit`, whose paths are the cluster's) checks local paths on disk: the model
folder holds config.json, *.safetensors and tokenizer.json, and the input matches at least one
file. s3:// and other remote URIs (a remote `model.path` is downloaded by each node at run time:
`operators/storage/checkpoint_cache.py`) are left to run time (checking them needs the storage
settings and the network).
"""
from vlbatch.pipeline.config.load import (
    FILE_RELATIVE_PATHS,
    apply_override,
    export_schema,
    job_schema,
    load_config,
    validate_config,
)
from vlbatch.pipeline.config.resources import ModelResources, ResourcesSection, StageResources
from vlbatch.pipeline.config.schema import (
    SCHEMA_PATH,
    EngineBudgets,
    ImageSection,
    InputColumns,
    InputSection,
    JobConfig,
    ModelSection,
    OutputSection,
    RaySection,
    ResumeSection,
    SamplingSection,
    StorageSection,
    TaskSection,
    VideoSection,
)

__all__ = [
    "FILE_RELATIVE_PATHS", "SCHEMA_PATH", "EngineBudgets", "ImageSection", "InputColumns", "InputSection",
    "JobConfig", "ModelSection", "ModelResources", "OutputSection", "RaySection", "ResourcesSection",
    "ResumeSection", "SamplingSection", "StageResources", "StorageSection", "TaskSection", "VideoSection",
    "apply_override", "export_schema", "job_schema", "load_config", "validate_config",
]
