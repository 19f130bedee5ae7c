"""The run's answer fingerprint: what a run's answers were made with, kept beside its rows; and the
preflight's whole `output` step (`check_output`: the output bucket exists; then `check_fingerprint`).

A pinned `output.run_id` (or a scheduled slot's) names one output folder; resume skips the
ids already committed there. If the rerun's config would answer differently (another
checkpoint, `sampling.max_tokens`, the system prompt, pixel budgets ...) those skipped rows
are stale answers. So the run folder holds `_fingerprint.json` (`FINGERPRINT_NAME`):

    {"version": 1, "fingerprint": {"model.path": ..., "sampling.max_tokens": 64, ...},
     "accepted_changes": [{"at": <UTC time>, "changed": {"sampling.max_tokens": [64, 32]}}]}

`fingerprint(cfg)` is a flat {dotted field: JSON value} of everything that changes answers:
- `model.path`, `model.checkpoint` (`checkpoint_identity`: a hash of config.json, the
  tokenizer / template / preprocessor files, and of each safetensors file's name, size, header
  and first and last `SAMPLE_BYTES`; a remote path: none, its path only), `model.dtype`,
  `model.backend`; a local checkpoint's path counts only when its identity differs too (a
  moved or copied checkpoint is the same one);
- every `sampling.*` field except `max_prompt_tokens` (a limit: it decides error rows, not answers);
- every `task.*` field, a response format's schema inlined (a `schema_file` is where the schema came from, not
  what it is: `answer_fields` leaves it out, of a stored fingerprint too, so the recorded task reads back as a task
  config: `vlbatch export` types its columns from it);
- `image.min_pixels` / `max_pixels`, and every `video.*` field except `decode_timeout_s` and
  `max_bytes` (limits, as above) and `decoder` / `decode_device` (every decoder returns the same frames:
  tests/test_media_torchcodec.py; the run id leaves them out too).
How the model runs (engine budgets, tensor parallelism, device, resources) and where rows come
from or go (input, output, resume) are not in it: resuming with more actors is the same run.

`check_fingerprint(cfg)` runs before any work (the preflight of `vlbatch run` / `validate`, before Ray starts; the
stored file read and the checkpoint hashed once per start): a stored fingerprint that differs is a `ConfigError`
naming each changed field, old -> new, and the two ways on, unless `resume.allow_config_change`
(`--allow-config-change`): then the old rows of ids already done are kept and the change is recorded; except the
TruncatedError rows a larger `sampling.max_tokens` can finish (cut at fewer tokens: `sink/base.truncated_below`),
which resume computes again. It returns a `FingerprintNote`, carried by the plan (`RunPlan.run.fingerprint`):
`pipeline/graph.run_job` (or a rerun with nothing to do) writes the file from it (once per run, and again after an
accepted change) and, at every start, deletes what a failed one left of writing it
(`operators/storage/io.replace_file`). A run folder from before fingerprints (rows, no file) is accepted with a
warning and gets the file.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

from vlbatch.operators.errors import ConfigError, MediaError
from vlbatch.operators.storage import bucket_exists, filesystem, is_object_store, join, read_bytes, replace_file
from vlbatch.operators.storage.named_file import CHECKPOINT_FILE, read_named_file
from vlbatch.operators.storage.options import is_local
from vlbatch.pipeline.config import JobConfig

log = logging.getLogger("vlbatch.pipeline")

FINGERPRINT_NAME = "_fingerprint.json"
VERSION = 1
SAMPLE_BYTES = 1 << 16  # of each safetensors file's data: its first and last 64 KiB
HEADER_MAX = 100_000_000  # the most of a safetensors header read (the format's own limit), whatever it claims
# small files of a checkpoint that change what it answers, hashed whole when present
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                    "video_preprocessor_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
NOT_ANSWERS = {"sampling": {"max_prompt_tokens"}, "image": {"max_bytes"},
               "video": {"decode_timeout_s", "max_bytes", "decoder", "decode_device"}}


def _safetensors_digest(h, path: Path) -> None:
    """Name, size, header and the first / last `SAMPLE_BYTES` of one safetensors file into `h`."""
    size = path.stat().st_size
    h.update(f"{path.name}\x1f{size}\x1f".encode())
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(head + f.read(min(n, size, HEADER_MAX)))  # the header: tensor names, dtypes, shapes, offsets
        h.update(f.read(SAMPLE_BYTES))
        f.seek(max(f.tell(), size - SAMPLE_BYTES))
        h.update(f.read(SAMPLE_BYTES))


def checkpoint_identity(path: str) -> str | None:
    """sha256 (24 hex chars) of what identifies a local checkpoint folder (module docstring);
    None for a remote one (its path stands for it) or a folder that is not there (check_paths
    says so)."""
    if not is_local(path):
        return None
    root = Path(path.removeprefix("file://"))
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for name in CHECKPOINT_FILES:
        p = root / name
        if p.is_file():  # read as a regular file of at most 64 MiB (a swap to /dev/zero: refused, never read)
            data = read_named_file(str(p), field="model.path", kind=CHECKPOINT_FILE)
            h.update(f"{name}\x1f{len(data)}\x1f".encode() + data)
    for p in sorted(root.glob("*.safetensors")):
        _safetensors_digest(h, p)
    return h.hexdigest()[:24]


def _flat(section: str, values: dict, skip: set[str] = frozenset()) -> dict:
    out = {}
    for key, value in values.items():
        if key in skip:
            continue
        if isinstance(value, dict):
            out.update(_flat(f"{section}.{key}", value))
        else:
            out[f"{section}.{key}"] = value
    return out


def fingerprint(cfg: JobConfig, sections: dict | None = None) -> dict:
    """{dotted field: JSON value} of everything that changes answers (module docstring); `sections`: the
    config's `answer_sections()` dumped already (the preflight's; None: dumped here)."""
    m = cfg.model
    sections = cfg.answer_sections() if sections is None else sections
    out = {"model.path": m.path, "model.checkpoint": checkpoint_identity(m.path), "model.dtype": m.dtype,
           "model.backend": m.backend}
    for section in ("sampling", "task", "image", "video"):
        keep = sections[section]
        if section == "image":
            keep = {k: v for k, v in keep.items() if k in ("min_pixels", "max_pixels")}
        out.update(_flat(section, keep, NOT_ANSWERS.get(section, set())))
    return answer_fields(out)


def task_fields(task: dict) -> dict:
    """A task section's JSON values (`TaskSection.model_dump(mode="json")`) as the fingerprint records them."""
    return answer_fields(_flat("task", task))


def answer_fields(flat: dict) -> dict:
    """`flat` (a fingerprint, or its `task.*` fields) without the response formats' `schema_file`: the schema
    is recorded inlined beside it, and a task config takes one of the two, not both. A fingerprint stored
    before this rule reads the same through it (`stored`), so its run resumes unchanged."""
    out = {k: v for k, v in flat.items() if k != "task.response_format.schema_file"}
    questions = out.get("task.questions")
    if isinstance(questions, list):
        out["task.questions"] = [_without_file(q) for q in questions]
    return out


def _without_file(question):
    fmt = question.get("response_format") if isinstance(question, dict) else None
    if not isinstance(fmt, dict) or "schema_file" not in fmt:
        return question
    return {**question, "response_format": {k: v for k, v in fmt.items() if k != "schema_file"}}


def _default(key: str):
    """The default of a dotted field (what a fingerprint written before the field existed means)."""
    section, _, name = key.partition(".")
    model = JobConfig.model_fields[section].annotation if section in JobConfig.model_fields else None
    field = getattr(model, "model_fields", {}).get(name)
    if field is None or field.is_required():
        return None
    return json.loads(json.dumps(field.default, default=list))


def changed_fields(old: dict, new: dict) -> dict:
    """{field: [old, new]} of the fields whose values differ (a field missing from `old`: its default).
    A local checkpoint moved or copied elsewhere (`model.path` differs, the same non-null
    `model.checkpoint`) is the same checkpoint: its path is not a change."""
    out = {}
    same_checkpoint = old.get("model.checkpoint") is not None and old.get("model.checkpoint") == new.get(
        "model.checkpoint")
    for key in sorted(set(old) | set(new)):
        if key == "model.path" and same_checkpoint:
            continue
        before = old[key] if key in old else _default(key)
        after = new[key] if key in new else _default(key)
        if before != after:
            out[key] = [before, after]
    return out


@dataclass(frozen=True)
class FingerprintNote:
    """What `check_fingerprint` found, carried by the plan (`RunPlan.fingerprint`): `uri` of the run's
    `_fingerprint.json`; `data` the file the start writes (None: the stored one is this config's), through
    `operators/storage/io.replace_file` (which first deletes what a killed earlier write left, at every
    start); `changes` accepted ({field: [old, new]}); `missing`: the folder had no file."""

    uri: str
    data: bytes | None
    changes: dict
    missing: bool


def stored(uri: str, storage) -> dict | None:
    """The run folder's `_fingerprint.json` at `uri`, its fields read through `answer_fields` (None: there is none)."""
    try:
        raw = read_bytes(uri, storage)
    except MediaError:  # not there: a new run (or one from before fingerprints)
        return None
    try:
        data = json.loads(raw)
        if not (isinstance(data, dict) and isinstance(data.get("fingerprint"), dict)):
            return None
        return {**data, "fingerprint": answer_fields(data["fingerprint"])}
    except ValueError:
        log.warning("%s is not valid JSON; it is written again", uri)
        return None


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def refusal(run_id: str, changes: dict) -> str:
    what = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in changes.items())
    return (f"output.run_id {run_id!r} already holds answers made with another config ({what}). "
            "Use a new output.run_id (or leave it unset: it is then derived from the config) to compute every "
            "answer again, or pass --allow-config-change (resume.allow_config_change=true) to keep the old rows "
            "of the ids already done and compute only the rest with the new config" + _grown(changes))


def _grown(changes: dict) -> str:
    """What --allow-config-change redoes when `sampling.max_tokens` grew (`sink/base.truncated_below`)."""
    old, new = changes.get("sampling.max_tokens", (None, None))
    if not (isinstance(old, int) and isinstance(new, int) and new > old):
        return ""
    return (" (the TruncatedError rows, structured answers cut at fewer tokens than the new sampling.max_tokens, "
            "are then computed again)")


def check_output(cfg: JobConfig, storage=None) -> None:
    """Before any work: the bucket of an object-store `output.uri` must exist (`ConfigError`
    naming output.uri otherwise). Nothing ever creates a bucket: a typo in output.uri must not
    make a new one. An unreachable endpoint is `StorageError` after the retries. `storage`: the
    preflight's `StorageOptions` (None: the config's)."""
    storage = cfg.storage.options() if storage is None else storage
    fs, path = filesystem(cfg.output.uri, storage)
    if not is_object_store(fs):
        return
    bucket = path.split("/", 1)[0]
    if not bucket_exists(fs, bucket, storage):
        raise ConfigError(f"output.uri: the bucket {bucket!r} of {cfg.output.uri!r} does not exist (or these "
                          "credentials cannot see it); buckets are never created: create it, or fix output.uri")


def check_fingerprint(cfg: JobConfig, run_id: str | None = None, storage=None,
                      sections: dict | None = None) -> FingerprintNote:
    """Before any work: the `FingerprintNote` of the run folder (`run_id`, `storage`, `sections`: the preflight's, None:
    from `cfg`); `ConfigError` naming every changed field when the stored fingerprint differs and
    `resume.allow_config_change` is off. Read and hashed once per start: the note carries what to write."""
    run_id = cfg.resolved_run_id() if run_id is None else run_id
    storage = cfg.storage.options() if storage is None else storage
    uri = join(cfg.output.uri.rstrip("/"), run_id, FINGERPRINT_NAME)
    old, new = stored(uri, storage), fingerprint(cfg, sections)
    if old is not None and old["fingerprint"] == new:
        return FingerprintNote(uri, None, {}, False)
    changes = {} if old is None else changed_fields(old["fingerprint"], new)
    if changes and not cfg.resume.allow_config_change:
        raise ConfigError(refusal(run_id, changes))
    history = list(old.get("accepted_changes", [])) if old is not None else []
    if old is not None:
        history.append({"at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "changed": changes})
    text = json.dumps({"version": VERSION, "fingerprint": new, "accepted_changes": history}, indent=2, sort_keys=True)
    return FingerprintNote(uri, text.encode(), changes, old is None)


def record_fingerprint(cfg: JobConfig) -> None:
    """Check and write in one go (tests, benchmarks: a run folder's file as a run leaves it)."""
    note = check_fingerprint(cfg)
    replace_file(note.uri, note.data, cfg.storage.options())
