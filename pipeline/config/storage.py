"""The job config's sections for where data lives: `output` (the sink's folder, an allow-list of
persistent filesystems) and `storage` (object storage and http(s) options, their limits)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from vlbatch.operators import sink as sink_pkg
from vlbatch.operators.storage.names import run_folder_name
from vlbatch.operators.storage.options import persistent_output_uri
from vlbatch.pipeline.config.choices import registry_choice
from vlbatch.pipeline.config.section import Section as _Section
from vlbatch.pipeline.config.types import DAY_S, Float, Int

SinkChoice = registry_choice(sink_pkg, "SINKS")


class ClipFilesSection(_Section):
    """`output.clip_files`: each clip of `video.clips` written as its own file under `<run>/_clips/`
    (`operators/media/clip_files.py`); off when absent."""

    format: Literal["mp4"] = Field("mp4", description="the clip files' container")
    codec: str = Field("libx264", min_length=1, description="an FFmpeg video encoder PyAV has (libx264, "
                                                             "libx265, mpeg4, ...); re-encoded, so cuts are "
                                                             "frame-exact")
    crf: Int = Field(23, ge=0, le=51, description="libx264 / libx265 quality (lower: better, larger files)")
    preset: Literal["ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
                    "veryslow"] = Field("veryfast", description="libx264 / libx265 speed against size")

    @field_validator("codec")
    @classmethod
    def _encoder_here(cls, v: str) -> str:
        from vlbatch.operators.media.clip_files import codec_problem

        why = codec_problem(v)
        if why is not None:
            raise ValueError(why)
        return v

    def settings(self):
        """The Ray-free `ClipFileSettings` (operators/media/clip_files.py)."""
        from vlbatch.operators.media.clip_files import ClipFileSettings

        return ClipFileSettings(format=self.format, codec=self.codec, crf=self.crf, preset=self.preset)


class OutputSection(_Section):
    # an allow-list (storage/options.OUTPUT_PROTOCOLS): memory:// would keep nothing, http(s) is read-only
    uri: Annotated[str, AfterValidator(persistent_output_uri)] = Field(
        ..., min_length=1, description="folder (local, relative to the config file's folder, file:// or s3://; "
                                       "nothing else: memory:// and http(s):// are refused); files go to "
                                       "<uri>/<run_id>/")
    run_id: Annotated[str | None, AfterValidator(run_folder_name)] = Field(  # '.' / '..' refused
        None, pattern=r"^[A-Za-z0-9._-]{1,128}$", description="None = a hash of the job's inputs (same job, same id)"
    )
    part_mb: Float | None = Field(32.0, gt=0.0, le=4096.0, description="a writer publishes a part file once it "
                                                            "holds this many MiB of rows (Arrow size; the zstd "
                                                            "file is smaller)")
    part_rows: Int | None = Field(None, ge=1, description="... or this many rows (None: by size only)")
    commit_interval_s: Float = Field(
        120.0, gt=0.0, le=DAY_S,
        description="... or once its oldest row is this old: a crash loses at most this window")
    format: SinkChoice = sink_pkg.SINKS.default
    clip_files: ClipFilesSection | None = Field(None, description="write each clip (video.clips) as a file under "
                                                                   "<run>/_clips/ and its URI in clip_uri; null: off")

    def roll_policy(self):
        """The writers' `RollPolicy` (vlbatch.operators.sink.rolling)."""
        from vlbatch.operators.sink.rolling import RollPolicy

        return RollPolicy(target_bytes=None if self.part_mb is None else int(self.part_mb * 2**20),
                          target_rows=self.part_rows, interval_s=self.commit_interval_s)


class StorageSection(_Section):
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    region: str | None = None
    anonymous: bool = False
    retries: Int = Field(5, ge=0, le=50)
    http_per_host: Int = Field(8, ge=1, description="http(s) media requests in flight per host, per decode actor")
    http_total_timeout_s: Float = Field(
        300.0, gt=0.0, le=DAY_S, description="an http(s) medium's whole response (headers and body) must arrive within "
                                   "max(this, the medium's max_bytes / http_min_bytes_per_s) seconds, else a "
                                   "StorageError row")
    http_min_bytes_per_s: Float = Field(
        65536.0, ge=0.0, le=1e12, description="an http(s) body slower than this over a 30 s window (a streamed "
                                     "shard: 30 s of waiting on the server) is a StorageError row (0 = no "
                                     "minimum rate)")
    allow_schemes: tuple[str, ...] = Field(
        (), description="schemes a remote manifest (s3://, http(s)://) may name besides its own kind of storage, "
                        "e.g. [https] for an s3 manifest of web images; 'file' lets it name local files")

    @field_validator("allow_schemes")
    @classmethod
    def _known_schemes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from vlbatch.operators.storage.options import SUPPORTED_PROTOCOLS

        unknown = [s for s in v if s.lower() not in SUPPORTED_PROTOCOLS]
        if unknown:
            raise ValueError(f"unknown scheme {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(SUPPORTED_PROTOCOLS)}")
        return tuple(s.lower() for s in v)

    def options(self):
        """The `StorageOptions` of manifests, media and the output sink: `retries` + 1 attempts in all."""
        from vlbatch.operators.storage import StorageOptions

        return StorageOptions.of(self)
