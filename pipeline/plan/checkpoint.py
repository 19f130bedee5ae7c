"""The checkpoint half of the start-up checks: `check_model(config)`, run by `vlbatch validate`
and at the start of `vlbatch run` before any Ray process starts (the resource half is
`pipeline/plan/fit.py`). What a model actor or a CPU actor would die on, found here in a
second, one line per problem naming the field (a step of `plan/preflight.py`):

- config.json is readable and its `model_type` one we implement (`operators/model/config.py`);
- the files the CPU stage loads: tokenizer.json, a chat template (chat_template.jinja or
  tokenizer_config.json's `chat_template`), preprocessor_config.json;
- the weights are safetensors (model.safetensors, or model.safetensors.index.json and every
  shard it names); nothing else is ever loaded: a folder holding only pytorch_model.bin, or a
  decoy `*.safetensors` without model.safetensors, is refused;
- `model.tensor_parallel_size` (and `expert_parallel`) divide the checkpoint's head, KV-head,
  linear-head, vocabulary, width and expert counts (`operators/parallel/plan.py`);
- every tensor's name and shape against config.json (safetensors headers only, no weight is
  read: `operators/model/loader.check_checkpoint`), so an edited head count is refused;
- every task response format compiles in the grammar engine within `model.engine.grammar`'s budget
  (`response_format_problems`: each distinct format once, in a child process killed at `compile_s`, against
  the checkpoint's vocabulary when it is local and sound, else tokenizer-free; a source over `max_bytes` is
  refused uncompiled; the refusal names the field and the question);
- (`model.engine.attention: triton` and `model.engine.delta_rule: fla` need CUDA: `plan/fit.device_problems`,
  against the cluster.)

An s3:// (or other remote) `model.path` is checked by reading its config.json (the architecture
and the tensor-parallel split) and by the download's own name checks (one listing: object keys
and the index's shard names stay inside the folder, `checkpoint_cache.check_names`); its other
files are the download's business (`operators/storage/checkpoint_cache.py`).
"""
from __future__ import annotations

import json
from pathlib import Path

from vlbatch.operators.errors import ConfigError, VlbatchError
from vlbatch.operators.storage.named_file import CHECKPOINT_JSON, NamedFileError, read_named_file
from vlbatch.operators.storage.names import printable, relative_name_problem
from vlbatch.operators.storage.options import is_local
from vlbatch.pipeline.config import JobConfig
from vlbatch.pipeline.plan.fit import problems_error

PROCESSOR_FILES = ("tokenizer.json", "preprocessor_config.json")
INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path, what: str) -> tuple[dict | None, str | None]:
    if not path.exists():
        return None, f"has no {what}"
    try:  # a regular file of at most 16 MiB: a FIFO or /dev/zero named config.json is refused, never read
        data = json.loads(read_named_file(str(path), field="model.path", kind=CHECKPOINT_JSON))
    except NamedFileError as e:
        return None, f"{what}: {e.reason}"
    except ValueError as e:
        return None, f"{what} is not readable JSON ({type(e).__name__}: {e})"
    if not isinstance(data, dict):
        return None, f"{what} is not a JSON object"
    return data, None


def _weights_problem(root: Path) -> str | None:
    """None when the weights are safetensors the loader reads (one file or an index + shards)."""
    index = root / INDEX_FILE
    if index.is_file():
        data, why = _read_json(index, INDEX_FILE)
        if why:
            return why
        weight_map = data.get("weight_map") or {}
        if not isinstance(weight_map, dict):
            return f"{INDEX_FILE}: weight_map is not a mapping of tensor names to shard files"
        shards = sorted({str(f) for f in weight_map.values()})
        if not shards:
            return f"{INDEX_FILE} names no shard files"
        unsafe = [f"{printable(str(f))!r} {why}" for f in sorted(set(weight_map.values()), key=str)
                  if (why := relative_name_problem(f)) is not None]
        if unsafe:  # untrusted names: never joined to the folder unchecked
            return f"{INDEX_FILE} names shard files outside the checkpoint folder: {'; '.join(unsafe[:4])}"
        missing = [s for s in shards if not (root / s).is_file()]
        return f"{INDEX_FILE} names shard files that are missing: {missing}" if missing else None
    if (root / "model.safetensors").is_file():
        return None
    others = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt"))
    found = f" (found {', '.join(others[:4])}; only model.safetensors or a {INDEX_FILE} is loaded)" if others else ""
    return f"has no model.safetensors or {INDEX_FILE}{found}"


def _chat_template_problem(root: Path) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return None
    data, _ = _read_json(root / "tokenizer_config.json", "tokenizer_config.json")
    if data and isinstance(data.get("chat_template"), str | list) and data["chat_template"]:
        return None
    return "has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)"


def processor_problems(root: Path) -> list[str]:
    """What the CPU stage's processor would miss in checkpoint folder `root` (tokenizer, chat
    template, processor configs); [] when it can load. Also called by the CPU stage itself."""
    out = [f"has no {name}" for name in PROCESSOR_FILES if not (root / name).is_file()]
    if (why := _chat_template_problem(root)) is not None:
        out.append(why)
    return out


def _architecture(raw: dict, where: str, config: JobConfig) -> list[str]:
    """The architecture is ours and the tensor-parallel split is even -> [] or the problems."""
    from vlbatch.operators.model.config import ModelConfig
    from vlbatch.operators.parallel.plan import ParallelPlan

    try:
        model_config = ModelConfig.from_dict(raw)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        return [f"model.path: {where}: {e}"]
    m = config.model
    try:
        ParallelPlan(m.tensor_parallel_size, 0, m.expert_parallel).check(model_config)
    except ConfigError as e:
        return [f"model.tensor_parallel_size: {e} in {where}"]
    return []


def _local_problems(config: JobConfig) -> list[str]:
    path = config.model.path
    root = Path(path.removeprefix("file://"))
    if not root.exists():
        return [f"model.path: {path} does not exist"]
    if not root.is_dir():
        return [f"model.path: {path} is not a directory (expected a checkpoint folder in the Hugging Face layout)"]
    raw, why = _read_json(root / "config.json", "config.json")
    problems = [f"model.path: {path} {why}"] if why else _architecture(raw, f"{path}/config.json", config)
    problems += [f"model.path: {path} {p}" for p in processor_problems(root)]
    if (why := _weights_problem(root)) is not None:
        problems.append(f"model.path: {path} {why}")
    return problems


def _remote_problems(config: JobConfig, storage) -> list[str]:
    """A remote checkpoint: its config.json alone (architecture, tensor-parallel split)."""
    from vlbatch.operators.storage import join, read_bytes

    uri = join(config.model.path.rstrip("/"), "config.json")
    try:
        raw = json.loads(read_bytes(uri, storage, max_bytes=16 << 20))
    except VlbatchError as e:
        return [f"model.path: cannot read {uri}: {e}"]
    except ValueError as e:
        return [f"model.path: {uri} is not readable JSON ({e})"]
    if not isinstance(raw, dict):
        return [f"model.path: {uri} is not a JSON object"]
    from vlbatch.operators.storage.checkpoint_cache import check_names

    try:  # keys and shard names that would leave the download folder
        check_names(config.model.path, storage)
    except VlbatchError as e:
        return [str(e) if str(e).startswith("model.path") else f"model.path: {e}"]
    return _architecture(raw, uri, config)


def check_model(config: JobConfig, storage=None, formats: dict | None = None) -> None:
    """ConfigError naming every problem of `model.path` a model or CPU actor would die on (see the
    module docstring); returns quietly when the checkpoint would load. `storage`: the preflight's
    `StorageOptions` (None: the config's); `formats`: its {field: (kind, spec)} (None: made here)."""
    local = is_local(config.model.path)
    if local:
        problems = _local_problems(config)
    else:
        problems = _remote_problems(config, config.storage.options() if storage is None else storage)
    if not problems and local:  # names and shapes: safetensors headers only
        from vlbatch.operators.model.loader import check_checkpoint as check_tensors

        try:
            check_tensors(config.model.path.removeprefix("file://"))
        except ConfigError as e:
            problems.append(f"model.path: {e}")
    vocabulary = _vocabulary(config.model.path) if local and not problems else None
    problems += response_format_problems(config, formats, vocabulary)
    if problems:
        raise problems_error(problems)


def response_format_problems(config: JobConfig, formats: dict | None = None,
                            vocabulary: dict | None = None) -> list[str]:
    """One line per task response format the grammar engine refuses (a JSON Schema feature or regex syntax
    xgrammar lacks) or that is over `model.engine.grammar`'s budget, naming its field and its question.
    Each distinct format is compiled once, in a child process the deadline kills
    (`operators/engine/grammar_compile.py`), against `vocabulary` ({"dir", "vocab_size", "stop_ids"}: the
    checkpoint's tokenizer; None: tokenizer-free). `formats`: {field: (kind, spec)} (None:
    `TaskSection.format_specs()` made here)."""
    fields = config.task.format_specs() if formats is None else formats
    if not fields:
        return []
    from vlbatch.operators.engine.grammar_compile import ChildCompiler, GrammarBudget
    from vlbatch.operators.engine.request import ResponseFormat

    limits = config.model.engine.grammar
    names = _question_names(config)
    compiler = ChildCompiler(vocabulary, GrammarBudget(limits.compile_s, limits.max_bytes))
    refused: dict[str, str | None] = {}  # format key -> its problem
    out = []
    try:
        for where, spec in fields.items():
            fmt = ResponseFormat(*spec)
            if fmt.key not in refused:
                try:
                    compiler.compile(fmt)
                    refused[fmt.key] = None
                except VlbatchError as e:
                    refused[fmt.key] = str(e)
            if refused[fmt.key] is not None:
                out.append(f"{where} (question {names.get(where, '?')!r}): {refused[fmt.key]}")
    finally:
        compiler.close()
    return out


def _question_names(config: JobConfig) -> dict[str, str]:
    """{field: prompt_name} of the task's response format fields (`answers.question_names`' rule, read from the
    sections here: no call back into the config on the start-up walk, `scripts/walk_calls.py`)."""
    from vlbatch.pipeline.config.answers import CAPTION_NAME

    names = {f"task.questions.{i}.response_format": q.name or f"q{i}" for i, q in enumerate(config.task.questions)}
    return {**names, "task.response_format": CAPTION_NAME}


def _vocabulary(path: str) -> dict | None:
    """What the grammar child compiles against for the local checkpoint at `path`: its tokenizer folder and
    vocabulary size (config.json); None when there is no size to read. No stop ids: they do not change what
    compiling costs."""
    root = Path(path.removeprefix("file://"))
    raw, _ = _read_json(root / "config.json", "config.json")
    size = (raw or {}).get("text_config", raw or {}).get("vocab_size")
    return {"dir": str(root), "vocab_size": size, "stop_ids": []} if isinstance(size, int) else None
