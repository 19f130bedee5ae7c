"""The job config's schema: one frozen pydantic section per YAML section, and `JobConfig`.

Each field states its type, default, bounds and description (these become
``configs/job.schema.json``); cross-field rules live in model validators, so whatever
reaches a `JobConfig` is consistent. A field naming an implementation
(`model.backend`, `model.engine.attention` / `delta_rule` / `moe`, `video.decoder`, `input.format`,
`output.format`) takes its
choices from that extension point's registry (`pipeline/config/choices.py`). Reading YAML,
overrides and error messages are `load.py`'s.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    model_validator,
)

from vlbatch.operators.kernels import attention as attention_pkg
from vlbatch.operators.kernels import delta_rule as delta_rule_pkg
from vlbatch.operators.kernels import moe as moe_pkg
from vlbatch.operators.media import decoders as decoders_pkg
from vlbatch.pipeline.config import answers as answers_pkg
from vlbatch.pipeline.config import formats as formats_pkg
from vlbatch.pipeline.config import model_backends as model_backends_pkg
from vlbatch.pipeline.config.answers import (
    CAPTION_NAME,
    Format,
    GrammarBudgetSection,
    Questions,
    question_names,
    questions_json_schema,
)
from vlbatch.pipeline.config.choices import registry_choice
from vlbatch.pipeline.config.resources import ResourcesSection
from vlbatch.pipeline.config.section import Section as _Section
from vlbatch.pipeline.config.storage import OutputSection, StorageSection
from vlbatch.pipeline.config.types import DAY_S, Float, Int

# the extension points' fields: choices, their docs and errors come from each one's registry
AttentionChoice = registry_choice(attention_pkg, "ATTENTION")
DeltaRuleChoice = registry_choice(delta_rule_pkg, "DELTA_RULE")
MoeChoice = registry_choice(moe_pkg, "MOE")
SourceChoice = registry_choice(formats_pkg, "SOURCES")
DecoderChoice = registry_choice(decoders_pkg, "DECODERS")
ModelBackendChoice = registry_choice(model_backends_pkg, "MODEL_BACKENDS")

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "configs" / "job.schema.json"


class EngineBudgets(_Section):
    """Budgets handed to `load_engine` (per model actor; `vlbatch.operators.engine.EngineConfig`)."""

    max_num_seqs: Int = Field(32, ge=1, description="sequences decoded together")
    max_num_batched_tokens: Int = Field(2048, ge=16, description="tokens per forward step (chunked prefill)")
    kv_cache_mb: Int = Field(256, ge=1, description="paged KV pool of the full-attention layers")
    prefix_cache_mb: Int = Field(128, ge=0, description="radix prefix cache (0 = off)")
    vision_cache_mb: Int = Field(256, ge=0, description="cached vision-tower outputs (0 = off)")
    memory_fraction: Float | None = Field(
        None, gt=0.0, le=1.0, description="size the KV pool and prefix cache from this share of the memory free "
                                          "after loading (kv_cache_mb / prefix_cache_mb, when given, override)")
    static_decode: bool = Field(False, description="decode steps padded to batch buckets (CUDA graphs on CUDA)")
    attention: AttentionChoice = attention_pkg.ATTENTION.default
    delta_rule: DeltaRuleChoice = delta_rule_pkg.DELTA_RULE.default
    moe: MoeChoice = moe_pkg.MOE.default
    grammar: GrammarBudgetSection = Field(GrammarBudgetSection(), description=GrammarBudgetSection.__doc__)

    def engine_kwargs(self) -> dict:
        out = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
               "kv_budget_bytes": self.kv_cache_mb << 20, "prefix_cache_bytes": self.prefix_cache_mb << 20,
               "vision_cache_bytes": self.vision_cache_mb << 20, "static_decode": self.static_decode,
               "attention": self.attention, "delta_rule": self.delta_rule, "moe": self.moe,
               "grammar_compile_s": self.grammar.compile_s, "grammar_max_bytes": self.grammar.max_bytes}
        if self.memory_fraction is not None:  # MB budgets only as explicit overrides
            out["memory_fraction"] = self.memory_fraction
            for name, field in (("kv_budget_bytes", "kv_cache_mb"), ("prefix_cache_bytes", "prefix_cache_mb")):
                if field not in self.model_fields_set:
                    del out[name]
        return out


class ModelSection(_Section):
    path: str = Field(..., min_length=1, description="checkpoint folder in the Hugging Face layout: a local path "
                                                     "(relative: to the config file's folder), an fsspec URI "
                                                     "(s3://..., downloaded once per node into cache_dir), or "
                                                     "bundled:shapes-tiny (the demo's model)")
    cache_dir: str | None = Field(None, description="node-local folder for downloaded checkpoints; None = "
                                                    "$VLBATCH_CACHE or ~/.cache/vlbatch/checkpoints")
    backend: ModelBackendChoice = model_backends_pkg.MODEL_BACKENDS.default
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when the actor has a GPU")
    engine: EngineBudgets = EngineBudgets()
    tensor_parallel_size: Int = Field(
        1, ge=1, le=64, description="ranks per model replica (one GPU each, one node; pipeline/backends/followers.py); "
                                    "resources.model.num_cpus / num_gpus are per rank")
    expert_parallel: bool = Field(False, description="MoE experts split whole across the replica's ranks "
                                                     "(else each expert's matrices are split)")

    @model_validator(mode="after")
    def _parallel(self) -> ModelSection:
        if self.tensor_parallel_size > 1 and self.backend != "engine":
            raise ValueError("tensor_parallel_size > 1 needs backend=engine")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("expert_parallel needs tensor_parallel_size > 1")
        return self


class InputColumns(_Section):
    media: str = Field("media_uri", min_length=1, description="column with the media: a URI (path, s3://, "
                                                              "http(s)://), binary bytes, or a struct of `bytes` "
                                                              "and `path` (Hugging Face datasets Image / Video)")
    media_type: str | None = Field(
        "media_type", description="column with 'image'/'video'; missing column or null -> inferred from extension"
    )
    questions: str | None = Field(None, description="list<string> column of questions (task.mode=questions)")
    keep: tuple[str, ...] = Field((), description="columns copied into every output row of their media, with "
                                                  "their Arrow types (webdataset: member extensions, as strings)")


class InputSection(_Section):
    uri: str = Field(..., min_length=1, description="manifest file, folder of manifests or glob; format=glob: a "
                                                    "glob of media, or a folder whose media (image and video files, "
                                                    "recursively) are read; local path (relative: to the config file's "
                                                    "folder; given by --set: to the current directory) or s3://")
    format: SourceChoice = formats_pkg.SOURCES.default
    columns: InputColumns = InputColumns()
    limit: Int | None = Field(None, ge=1, description="process only the first N manifest rows")
    follow_symlinks: bool = Field(False, description="format=glob: read a symlink that leads out of the glob's "
                                                     "folder (by default its row is an InputError, never read)")


class TaskSection(_Section):
    mode: Literal["caption", "questions", "scan"] = Field(
        "caption", description="scan: no model; every request is read, decoded and preprocessed as a real run "
                               "would and gets its row (status, error, token counts; answer null): broken files "
                               "and the job's token cost. Its requests: the questions where there are any, "
                               "else the caption prompt (with task.caption: the questions and the caption)")
    prompt: str = Field(answers_pkg.IMAGE_PROMPT, min_length=1,
                        description="caption prompt (mode=caption, or task.caption=true)")
    video_prompt: str | None = Field(None, description="caption prompt for videos; None = `prompt` where it is set, "
                                                       f"else {answers_pkg.VIDEO_PROMPT!r}")
    questions: Questions = Field(
        (), description="questions asked of every media when the manifest has no questions column (mode=questions): "
                        "a string, or {name, prompt, response_format} (pipeline/config/answers.py)",
        json_schema_extra=questions_json_schema)
    response_format: Format = Field(
        None, description="constrain the caption's answer (mode=caption, or task.caption=true); None = free text")
    caption: bool = Field(
        False, description="mode=questions: also caption every media (task.prompt / video_prompt), one more row "
                           "after its questions (request_index = its number of questions), on the same decode, "
                           "preprocess and prefix")
    system_prompt: str | None = Field(
        None, description="system turn of every request. Tokenised as text, like the prompts and the manifest's "
                          "questions: a control-token string in it (<|im_end|>, <|im_start|>, <|image_pad|>, "
                          "<think>) is plain text, never the chat template's control token; there is no opt-in")
    thinking: bool = Field(False, description="enable_thinking in the chat template")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """`prompt: null` (e.g. `--set task.prompt=null`) means not set: the default, and not a field the
        mode would ignore."""
        if isinstance(data, dict) and "prompt" in data and data["prompt"] is None:
            data = {k: v for k, v in data.items() if k != "prompt"}
        return data

    def question_prompts(self) -> list[str]:
        """task.questions' texts, in order."""
        return [q.prompt for q in self.questions]

    def has_formats(self) -> bool:
        """Whether any prompt of task is constrained (a response format)."""
        return self.response_format is not None or any(q.response_format is not None for q in self.questions)

    def format_specs(self) -> dict[str, tuple[str, str]]:
        """{field: (kind, spec)} of every response format of task, by its field in the config."""
        out = {f"task.questions.{i}.response_format": q.response_format.spec()
               for i, q in enumerate(self.questions) if q.response_format is not None}
        if self.response_format is not None:
            out["task.response_format"] = self.response_format.spec()
        return out

    def prompt_formats(self) -> dict[str, tuple[str, str]]:
        """{prompt_name: (kind, spec)} of every constrained prompt of task (its questions, the caption)."""
        out = {n: q.response_format.spec() for n, q in zip(question_names(self.questions), self.questions,
                                                            strict=True) if q.response_format is not None}
        if self.response_format is not None:
            out[CAPTION_NAME] = self.response_format.spec()
        return out

    def ignored_fields(self, questions_column: str | None) -> list[str]:
        """Messages naming each field set in this config that `mode` would not use (a config
        error: never silence). Scan mode uses them all."""
        out = []
        if self.mode == "caption":
            for name, used in (("task.questions", self.questions), ("input.columns.questions", questions_column),
                               ("task.caption", self.caption)):
                if used:
                    out.append(f"{name}: not used by task.mode=caption; to ask questions set task.mode=questions "
                               "(and task.caption=true to caption each media too)")
        elif self.mode == "questions" and not self.caption:
            for name in ("prompt", "video_prompt", "response_format"):
                if name in self.model_fields_set and getattr(self, name) is not None:
                    out.append(f"task.{name}: not used by task.mode=questions without a caption; set "
                               f"task.caption=true to caption each media too, or remove task.{name} (--set "
                               f"task.{name}=null)")
        return out


class SamplingSection(_Section):
    temperature: Float = Field(0.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=1)
    max_tokens: Int = Field(128, ge=1, le=65536)
    seed: Int = Field(0, ge=0, description="per-request seeds derive from this and the request id")
    max_prompt_tokens: Int | None = Field(
        None, ge=1, description="a request whose prompt (text and the media's visual tokens) is longer is an "
                                "InputError row, given no model time; None = the model's context length "
                                "(max_position_embeddings in its config.json)")


class ImageSection(_Section):
    min_pixels: Int | None = Field(None, ge=1, description="None = the model's preprocessor_config value")
    max_pixels: Int | None = Field(None, ge=1)
    max_bytes: Int = Field(64 << 20, ge=1, description="files larger than this are error rows (InputError)")

    @model_validator(mode="after")
    def _order(self) -> ImageSection:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must be <= max_pixels")
        return self


class ClipsSection(_Section):
    """`video.clips`: cut each video into clips and caption each (one row per clip and prompt).
    Ray-free rules in `operators/media/clips.py` (`ClipRule`)."""

    mode: Literal["none", "fixed", "scenes"] = Field(
        "none", description="none: one row per whole video (the default); fixed: windows of window_s every "
                            "stride_s; scenes: shots cut by the detector, longer ones split into windows of window_s")
    window_s: Float = Field(10.0, gt=0.0, le=3600.0,
                            description="fixed: window length; scenes: the longest clip (seconds, > 0)")
    stride_s: Float | None = Field(None, gt=0.0, le=3600.0, description="fixed: distance between window starts; "
                                   "null = window_s (smaller overlaps; larger leaves gaps: allow_gaps)")
    min_clip_s: Float = Field(1.0, ge=0.0, le=3600.0, description="scenes: shorter shots merge into a neighbour; a "
                              "last window shorter than this is dropped; a video shorter is one clip")
    detector: Literal["content", "adaptive"] = Field(
        "content", description="scenes: PySceneDetect's detector, content | adaptive")
    threshold: Float | None = Field(None, gt=0.0, le=255.0, description="the detector's threshold; null = its default "
                                                              "(content 27, adaptive 3)")
    allow_gaps: bool = Field(False, description="fixed: allow stride_s > window_s (frames between windows unused)")

    @model_validator(mode="after")
    def _rules(self) -> ClipsSection:
        if self.stride_s is not None and self.stride_s > self.window_s and not self.allow_gaps:
            raise ValueError(f"stride_s {self.stride_s:g} > window_s {self.window_s:g} leaves gaps between windows; "
                             "set allow_gaps: true if that is meant")
        return self

    def rule(self):
        """The Ray-free `ClipRule` of this section (`operators/media/clips.py`)."""
        from vlbatch.operators.media.clips import ClipRule

        return ClipRule(mode=self.mode, window_s=self.window_s, stride_s=self.stride_s, min_clip_s=self.min_clip_s,
                        detector=self.detector, threshold=self.threshold, allow_gaps=self.allow_gaps)


class VideoSection(_Section):
    fps: Float | None = Field(2.0, gt=0.0, le=1000.0, description="sampling rate; exclusive with num_frames")
    num_frames: Int | None = Field(None, ge=1)
    min_frames: Int = Field(4, ge=1)
    max_frames: Int = Field(768, ge=1)
    min_pixels: Int | None = Field(None, ge=1, description="per frame; None = the model's video_preprocessor value")
    max_pixels: Int | None = Field(None, ge=1)
    decoder: DecoderChoice = Field(decoders_pkg.DECODERS.default,  # `backend`: its old name
                                   validation_alias=AliasChoices("decoder", "backend"))
    decode_device: Literal["cpu", "cuda", "model-cpu"] = Field(
        "cpu", description="cuda: decode with TorchCodec on the model actor's GPU (NVDEC), inside the model stage; "
                           "needs model.device cuda (or auto on a GPU node) and torchcodec; the CPU stage then only "
                           "probes and samples, and ships the video's bytes; model-cpu: the same deferred path "
                           "decoding on the model actor's CPU (it tests that path without a GPU)")
    decode_timeout_s: Float = Field(60.0, gt=0.0, le=DAY_S, description="decoder subprocess is killed after this")
    max_bytes: Int = Field(2 << 30, ge=1)
    clips: ClipsSection = ClipsSection()

    @model_validator(mode="after")
    def _exclusive(self) -> VideoSection:
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("set either fps or num_frames, not both (set fps: null to use num_frames)")
        if self.min_frames > self.max_frames:
            raise ValueError("min_frames must be <= max_frames")
        if self.clips.mode != "none" and self.decode_device != "cpu":
            raise ValueError(f"clips.mode {self.clips.mode} cuts videos on the CPU stage; it needs decode_device: cpu "
                             f"(got {self.decode_device})")
        return self


class ResumeSection(_Section):
    enabled: bool = Field(True, description="skip requests already committed under the same run id")
    retry_transient: bool = Field(True, description="re-run error rows whose error is transient")
    allow_config_change: bool = Field(
        False, description="resume a run whose answers were made with another config (pipeline/plan/fingerprint.py): "
                           "keep the old rows of the ids already done (`vlbatch run --allow-config-change`)")


class RaySection(_Section):
    address: str | None = Field(None, description="Ray (GCS) address to join; None = $RAY_ADDRESS, else a new local "
                                                  "Ray; 'auto' = the Ray already running on this machine")
    progress_interval_s: Float = Field(10.0, gt=0.0, le=DAY_S, description="log line period when not on a terminal")
    node_loss_timeout_s: Float = Field(
        300.0, gt=0.0, le=DAY_S, description="seconds a stage may go without any live node that could hold its "
                                   "actor (every such node lost mid-run) before the run stops (exit 8; committed "
                                   "rows are kept): time for a node to come back or an autoscaler to add one")
    metrics: bool = Field(True, description="export the run's counters, queue depths, model-call latency and model "
                                            "busy fraction to Ray's metrics (each node's Prometheus endpoint), "
                                            "tagged job and run_id")
    block_mb: Int = Field(
        16, ge=1, le=1024, description="most MiB of a Ray Data block of preprocessed media; a model task takes "
                                       "whole blocks, so smaller blocks reach the model and commit sooner "
                                       "(Ray's default: 128)")


class JobConfig(_Section):
    model: ModelSection
    input: InputSection
    task: TaskSection = TaskSection()
    resources: ResourcesSection = ResourcesSection()  # beside task: validation walks answers -> resources -> here
    sampling: SamplingSection = SamplingSection()
    image: ImageSection = ImageSection()
    video: VideoSection = VideoSection()
    output: OutputSection
    storage: StorageSection = StorageSection()
    resume: ResumeSection = ResumeSection()
    ray: RaySection = RaySection()
    max_error_fraction: Float = Field(0.05, ge=0.0, le=1.0, description="exit non-zero above this error share "
                                      "(and only with at least min_error_rows error rows)")
    min_error_rows: Int = Field(10, ge=0, description="exit non-zero only with at least this many error rows (and "
                                "an error share above max_error_fraction): one bad file in a small trial is no "
                                "failed run")

    @model_validator(mode="after")
    def _task_input_agree(self) -> JobConfig:
        gpus = self.resources.model.num_gpus
        if self.model.tensor_parallel_size > 1 and gpus != int(gpus):
            raise ValueError("resources.model.num_gpus must be a whole number when model.tensor_parallel_size > 1 "
                             "(each rank holds its own GPUs)")
        if self.task.mode == "questions" and not self.input.columns.questions and not self.task.questions:
            raise ValueError("task.mode=questions needs input.columns.questions or task.questions")
        if self.task.has_formats() and self.model.backend != "engine":
            raise ValueError(f"task response formats need model.backend=engine (model.backend={self.model.backend} "
                             "decodes free text only)")
        ignored = self.task.ignored_fields(self.input.columns.questions)
        if ignored:
            raise ValueError("\n  ".join(ignored))
        if self.input.format in ("glob", "webdataset") and self.input.columns.questions:
            raise ValueError(f"input.format={self.input.format} has no questions column; use task.questions")
        if self.input.format == "glob" and self.input.columns.keep:
            raise ValueError("input.format=glob has no columns to keep")
        if self.output.clip_files is not None and self.video.clips.mode == "none":
            raise ValueError("output.clip_files writes the clips of video.clips, but video.clips.mode is none; "
                             "set video.clips.mode (fixed | scenes) or remove output.clip_files")
        return self

    def answer_sections(self) -> dict:
        """{section: its JSON values} of the sections that determine the answers: the run id's and the
        fingerprint's basis (`plan/fingerprint.py`), dumped once per start by the preflight."""
        return self.model_dump(mode="json", include={"model", "input", "task", "sampling", "image", "video"})

    def answer_basis(self) -> tuple[dict, str, dict[str, tuple[str, str]]]:
        """(`answer_sections()`, the run id made from them, {field: (kind, spec)} of every task response
        format, e.g. `task.questions.2.response_format`): what the preflight reads of the config, made once."""
        sections = self.answer_sections()
        return sections, self.resolved_run_id(sections), self.task.format_specs()

    def resolved_run_id(self, sections: dict | None = None) -> str:
        """The run id: `output.run_id`, else a hash of what determines the answers (`sections`:
        `answer_sections()` made already; None: made here).

        Resources, output and resume settings (and how the model is split over ranks)
        are excluded so the same job rerun with more actors still resumes the same run.
        """
        if self.output.run_id:
            return self.output.run_id
        sections = self.answer_sections() if sections is None else sections
        basis = {name: dict(values) for name, values in sections.items()}  # popped below: a copy
        for how in ("engine", "tensor_parallel_size", "expert_parallel"):  # how the model runs, not what it answers
            basis["model"].pop(how, None)
        if self.task.response_format is None:  # the default: run ids made before the field existed stay
            basis["task"].pop("response_format", None)
        if not self.input.follow_symlinks:  # the default: run ids made before the field existed stay
            basis["input"].pop("follow_symlinks", None)  # (on: links are read that a default run refused)
        for how in ("decoder", "decode_device"):  # every decoder returns the same frames (test_media_torchcodec)
            basis["video"].pop(how, None)
        digest = hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()
        return f"run-{digest[:12]}"
