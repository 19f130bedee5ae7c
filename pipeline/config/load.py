"""Reading a job config: YAML, ``--set`` overrides, relative paths, one error naming every bad field.

`load_config(path, overrides)` is the entry point used by `jobs/` and tests. Relative
local paths in the file (`model.path`, `input.uri`, `output.uri`) resolve against the config
file's folder, so a config means the same from any working directory; the same paths given
by ``--set`` overrides resolve against the current directory (both made absolute before the
run id is derived from them); what `validate_config` gets directly is taken as given. Every
problem becomes one `ConfigError` whose message names each bad field (dotted path) and, for
unknown fields, the allowed ones. `export_schema(path)` writes ``configs/job.schema.json``
for editors (``python -m vlbatch.pipeline.config --schema``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.storage.named_file import JOB_CONFIG, NamedFileError, read_named_file
from vlbatch.pipeline.config.bounds import MAX_DEPTH, size_problem
from vlbatch.pipeline.config.schema import SCHEMA_PATH, JobConfig


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))


def _allowed_fields(loc: tuple) -> list[str]:
    """Field names allowed at the parent of `loc` (for 'extra field' errors)."""
    model: Any = JobConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return sorted(model.model_fields)


def _format(exc: ValidationError, overrides: tuple[str, ...] = ()) -> str:
    lines = []
    for err in exc.errors():
        where = _loc(err)
        msg = err["msg"].removeprefix("Value error, ")
        head = msg.split(":", 1)[0]
        if (not where and head.count(".") and " " not in head) or (where and head.startswith(where + ".")):
            lines.append(msg)  # a whole-config check whose message starts with the dotted field it is about
            continue
        where = where or "<config>"
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; allowed: {', '.join(_allowed_fields(err['loc']))}"
        elif err["type"] == "missing":
            msg = "required field is missing"
        origin = _from_override(where, overrides)
        lines.append(f"{where}: {msg}{f' (from --set {origin})' if origin else ''}")
    return "invalid job config:\n  " + "\n  ".join(lines)


def _from_override(where: str, overrides: tuple[str, ...]) -> str | None:
    """The last ``--set`` that gave the field `where` (dotted) or a section holding it, or a field in it."""
    loc = tuple(where.split("."))
    found = None
    for ov in overrides:
        key = _override_key(ov)
        if loc[: len(key)] == key or key[: len(loc)] == loc:
            found = ov
    return found


def _mark(mark, *, column_only: bool = False) -> str:
    """A PyYAML mark (0-based line / column) -> 'line L, column C' as editors count (1-based)."""
    return f"column {mark.column + 1}" if column_only else f"line {mark.line + 1}, column {mark.column + 1}"


def yaml_problem(e: yaml.YAMLError, *, column_only: bool = False) -> tuple[str | None, str]:
    """(where, what) of a YAML error, one line each: PyYAML's own text spans lines and names the
    text it parsed as "<unicode string>"; its marks and problem are what a user needs.
    `column_only`: a one-line text (a ``--set`` value), so no line numbers."""
    problem_mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if problem_mark is None or not problem:  # a ReaderError (a control character) or a bare YAMLError
        position = getattr(e, "position", None)
        where = None if position is None else f"character {position + 1}"
        return where, " ".join(str(e).replace('"<unicode string>"', "the text").split())
    what = " ".join(problem.split())
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark is not None:
        what += f" ({' '.join(context.split())} at {_mark(context_mark, column_only=column_only)})"
    elif context:
        what += f" ({' '.join(context.split())})"
    return _mark(problem_mark, column_only=column_only), what


def apply_override(data: dict, override: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML. A bad one is a
    one-line ConfigError starting with ``--set <the override>``."""
    if "=" not in override:
        raise ConfigError(f"--set {override}: expected KEY.PATH=VALUE")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {override}: empty field name in {key.strip()!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        where, what = yaml_problem(e, column_only=True)
        raise ConfigError(f"--set {override}: the value is not valid YAML: {where + ': ' if where else ''}{what}"
                          ) from None
    except RecursionError:
        raise ConfigError(f"--set {override}: the value is nested too deeply") from None
    if (why := size_problem(value)) is not None:
        raise ConfigError(f"--set {override}: the value {why}")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate_config(data: dict, overrides: tuple[str, ...] = ()) -> JobConfig:
    """dict -> JobConfig, or ConfigError naming every bad field (and the ``--set`` of `overrides` that gave it)."""
    if not isinstance(data, dict):
        raise ConfigError("invalid job config: the top level must be a mapping of sections")
    try:
        return JobConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, tuple(overrides))) from None


# (section, field) of the paths that resolve against the config file's folder when relative.
FILE_RELATIVE_PATHS = (("model", "path"), ("input", "uri"), ("output", "uri"))


BUNDLED = "bundled:"  # model.path: bundled:<name> is a checkpoint shipped in vlbatch.models


def bundled_model(value: str) -> str:
    """``bundled:<name>`` -> the absolute folder of that bundled checkpoint (the same from any directory)."""
    from vlbatch import models

    root = models.SHAPES_TINY.parent
    names = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
    name = value[len(BUNDLED):]
    if name not in names:  # a listed folder name: never a path (`..`, `/`) of the user's choosing
        raise ConfigError(f"model.path: no bundled model {name!r} (bundled: {', '.join(names)})")
    return str(root / name)


def _resolve_file_paths(data: dict, base: Path, only: set[tuple[str, str]] | None = None) -> None:
    """Relative local paths of `FILE_RELATIVE_PATHS` in `data` (those in `only`, when given) ->
    absolute under `base`, `~` expanded (in place). Globs stay globs (`media/*` -> `/abs/media/*`).
    `model.path: bundled:<name>` -> the bundled checkpoint's folder."""
    for section, key in FILE_RELATIVE_PATHS:
        node = data.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if (only is not None and (section, key) not in only) or not isinstance(value, str) or not value:
            continue
        if (section, key) == ("model", "path") and value.startswith(BUNDLED):
            node[key] = bundled_model(value)
            continue
        if value.startswith("~"):
            value = node[key] = os.path.expanduser(value)
        if "://" not in value and not value.startswith("/"):
            node[key] = os.path.normpath(base / value)


def _resolve_schema_files(data: dict, base: Path) -> None:
    """Relative `schema_file`s of task.response_format and task.questions[*].response_format -> absolute
    under `base` (the config file's folder), in place; given by --set they stay the current directory's."""
    task = data.get("task")
    if not isinstance(task, dict):
        return
    questions = task.get("questions")
    holders = [task, *(q for q in questions if isinstance(q, dict))] if isinstance(questions, list) else [task]
    for holder in holders:
        fmt = holder.get("response_format")
        value = fmt.get("schema_file") if isinstance(fmt, dict) else None
        if isinstance(value, str) and value:
            value = os.path.expanduser(value)
            fmt["schema_file"] = value if value.startswith("/") else os.path.normpath(base / value)


def _override_key(override: str) -> tuple[str, ...]:
    return tuple(override.split("=", 1)[0].strip().split("."))


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a YAML job config, resolve its relative paths against its folder, apply
    ``a.b=value`` overrides (as given), validate everything."""
    p = Path(path)
    data = _read_yaml(p)
    if not isinstance(data, dict):
        raise ConfigError(f"job config {p}: the top level must be a mapping of sections")
    _resolve_file_paths(data, p.absolute().parent)
    _resolve_schema_files(data, p.absolute().parent)
    for ov in overrides:
        apply_override(data, ov)
    # an overridden path is the current directory's: made absolute before the run id is derived from
    # it, so the same command resumes the same run from any directory
    keys = [_override_key(ov) for ov in overrides]
    _resolve_file_paths(data, Path.cwd(), {path for path in FILE_RELATIVE_PATHS for k in keys if path[: len(k)] == k})
    return validate_config(data, tuple(overrides))


def _read_yaml(p: Path):
    """The parsed YAML of the config file `p`; ConfigError in one line naming `p` (and where in it)."""
    try:  # a regular file of at most 1 MiB (`vlbatch validate /dev/zero` reads nothing)
        text = read_named_file(str(p), field="job config", kind=JOB_CONFIG).decode("utf-8")
    except NamedFileError as e:
        raise ConfigError(f"cannot read job config {p}: {e.reason}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"job config {p}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        where, what = yaml_problem(e)
        raise ConfigError(f"job config {p}{', ' + where if where else ''}: not valid YAML: {what}") from None
    except RecursionError:
        raise ConfigError(f"job config {p}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    if (why := size_problem(data)) is not None:
        raise ConfigError(f"job config {p}: {why}")
    return data



def job_schema() -> dict:
    """The JSON schema of a job config (for editors: yaml-language-server)."""
    schema = JobConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "vlbatch job config"
    return schema


def export_schema(path: str | Path = SCHEMA_PATH) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(job_schema(), indent=2, sort_keys=True) + "\n")
    return p
