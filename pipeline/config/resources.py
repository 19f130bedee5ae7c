"""The job config's `resources` section: each stage's Ray resources and actor pool bounds."""
from __future__ import annotations

from pydantic import Field, model_validator

from vlbatch.pipeline.config.section import Section as _Section
from vlbatch.pipeline.config.types import Float, Int


class StageResources(_Section):
    """Resources of one CPU stage. min/max actors bound the autoscaling actor pool."""

    num_cpus: Float = Field(1.0, gt=0.0, le=1024.0)
    memory_gb: Float | None = Field(None, gt=0.0, le=65536.0, description="Ray memory reservation per task/actor")
    min_actors: Int = Field(1, ge=1)
    max_actors: Int = Field(2, ge=1)
    batch_size: Int = Field(8, ge=1, description="media rows per call")

    @model_validator(mode="after")
    def _bounds(self) -> StageResources:
        if self.min_actors > self.max_actors:
            raise ValueError("min_actors must be <= max_actors")
        return self


class ModelResources(StageResources):
    num_gpus: Float = Field(0.0, ge=0.0, le=64.0, description="GPUs per model actor; 0 = run on CPU")
    batch_size: Int = Field(16, ge=1, description="media rows per model-stage call (the commit granularity)")
    max_concurrent_batches: Int = Field(
        8, ge=1, description="calls running at once on one model actor; they all feed one continuous batch")
    batch_visual_tokens: Int = Field(
        16384, ge=1, description="visual tokens in flight per model actor: a call waits while the calls already in "
                                 "the engine hold more (a call alone always runs)")


class WriteResources(StageResources):
    batch_size: Int | None = Field(
        None, ge=1, description="media rows per write call; None: each model block as it comes. A number makes Ray "
                                "Data gather that many rows before a call: they wait there, unwritten, past "
                                "output.commit_interval_s whenever the model makes fewer in that time")


class ResourcesSection(_Section):
    fuse_cpu_stages: bool = Field(
        True, description="true: decode and preprocess run in one CPU actor pool sized by `preprocess` (one process "
                          "fewer, frames never leave it; `decode` is unused); false: one pool each")
    decode: StageResources = StageResources()
    preprocess: StageResources = StageResources()
    model: ModelResources = ModelResources(min_actors=1, max_actors=1)
    write: WriteResources = WriteResources(num_cpus=0.25, min_actors=1, max_actors=4)
