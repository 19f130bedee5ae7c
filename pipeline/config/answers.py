"""Structured answers in the job config: a prompt's `response_format` and a named question.

    task:
      questions:
        - "How many people are in the picture?"                  # free text, named q0
        - {name: tags, prompt: "Tag this image.", response_format: {type: json_schema, schema_file: tags.json}}
        - {name: has_text, prompt: "Is there text?", response_format: {type: choice, choices: ["yes", "no"]}}
        - {name: year, prompt: "What year?", response_format: {type: regex, pattern: "[12][0-9]{3}"}}
      response_format: {...}    # the caption's (task.prompt / video_prompt)

Checked here, cheaply (no torch): the fields each type needs and no others, a JSON Schema against
its meta-schema (the `jsonschema` library), `schema_file` read as JSON (a relative path: against the
config file's folder, resolved by `load.py`; the schema is inlined, so the run id and fingerprint follow
its content), a regex compiled by Python's `re`, an empty choice list. What the grammar engine itself
refuses (an unsupported JSON Schema feature, regex syntax xgrammar lacks) is the preflight's
`checkpoint` step (`plan/checkpoint.check_response_formats`), which imports xgrammar only when a
format is configured. `spec()` is the `(kind, spec)` pair the model stage makes an engine
`ResponseFormat` of (torch-free here).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PlainSerializer, field_serializer, model_validator

from vlbatch.operators.storage.named_file import SCHEMA_FILE, NamedFileError, read_named_file
from vlbatch.pipeline.config.bounds import MAX_DEPTH, size_problem
from vlbatch.pipeline.config.section import Section
from vlbatch.pipeline.config.types import Float, Int

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"  # a column name in every format (export's media layout)
CAPTION_NAME = "caption"  # the caption request's prompt_name
IMAGE_PROMPT = "Describe this image in detail."  # task.prompt's default
VIDEO_PROMPT = "Describe this video in detail."  # a video's caption prompt when neither prompt is set


class ResponseFormatSection(Section):
    type: Literal["json_schema", "choice", "regex"] = Field(
        ..., description="json_schema: a JSON value valid for `schema` / `schema_file`; choice: exactly one of "
                         "`choices`; regex: a string matching `pattern` (whole)")
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="type=json_schema: the schema inline")
    schema_file: str | None = Field(None, description="type=json_schema: a JSON file holding the schema (relative: to "
                                                      "the config file's folder); read when the config loads")
    choices: tuple[str, ...] | None = Field(None, description="type=choice: the allowed answers")
    pattern: str | None = Field(None, description="type=regex: the pattern the whole answer matches")

    model_config = {**Section.model_config, "populate_by_name": True}

    @model_validator(mode="before")
    @classmethod
    def _read_schema_file(cls, data: Any) -> Any:
        """schema_file -> its JSON inlined as `schema` (both given: refused)."""
        if not isinstance(data, dict) or not data.get("schema_file"):
            return data
        if data.get("schema") is not None or data.get("json_schema") is not None:
            raise ValueError("set either schema or schema_file, not both")
        path = Path(str(data["schema_file"])).expanduser()
        try:  # a regular file of at most 1 MiB: /dev/zero or a FIFO is refused at once, never read
            loaded = json.loads(read_named_file(str(path), field="schema_file", kind=SCHEMA_FILE).decode("utf-8"))
        except NamedFileError as e:
            raise ValueError(str(e)) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"schema_file: {path} is not JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"schema_file: {path} is nested too deeply (at most {MAX_DEPTH} levels)") from None
        if (why := size_problem(loaded)) is not None:
            raise ValueError(f"schema_file: {path} {why}")
        return {**data, "schema": loaded}

    @model_validator(mode="after")
    def _fields_of_type(self) -> ResponseFormatSection:
        given = {k for k in ("json_schema", "choices", "pattern") if getattr(self, k) is not None}
        need = {"json_schema": "json_schema", "choice": "choices", "regex": "pattern"}[self.type]
        shown = {"json_schema": "schema (or schema_file)", "choices": "choices", "pattern": "pattern"}
        if need not in given:
            raise ValueError(f"type={self.type} needs {shown[need]}")
        if given - {need}:
            raise ValueError(f"type={self.type} does not use {', '.join(shown[k] for k in sorted(given - {need}))}")
        if self.type == "json_schema":
            check_json_schema(self.json_schema)
        elif self.type == "choice":
            if not self.choices:
                raise ValueError("choices: the list is empty; give at least one answer")
            if any(not c for c in self.choices) or len(set(self.choices)) != len(self.choices):
                raise ValueError("choices: every choice must be a distinct, non-empty string")
        else:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern: not a regular expression: {e}") from None
        return self

    def spec(self) -> tuple[str, str]:
        """(kind, spec): the engine's `ResponseFormat(kind, spec)` (schema as sorted JSON text)."""
        if self.type == "json_schema":
            return "json_schema", json.dumps(self.json_schema, sort_keys=True)
        if self.type == "choice":
            return "choice", json.dumps(list(self.choices))
        return "regex", self.pattern


def check_json_schema(schema: dict) -> None:
    """ValueError (one line: the meta-schema's complaint and where) when `schema` is not valid JSON Schema."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the top level"
        raise ValueError(f"schema: not a valid JSON Schema at {where}: {e.message}") from None


class GrammarBudgetSection(Section):
    """`model.engine.grammar`: what compiling one response format may cost (`operators/engine/grammar_compile.py`).
    Beside the engine's other budgets, as it limits each model actor's grammar engine; a limit, not part of the
    run id or the fingerprint."""

    compile_s: Float = Field(10.0, gt=0.0, le=3600.0, description=(
        "seconds one response format's grammar may take to compile (against the checkpoint's vocabulary, in a "
        "child process killed at the deadline): validate refuses a format past it, naming its question; at run "
        "time such a format is an InputError row for its question only"))
    max_bytes: Int = Field(128 << 10, ge=1, le=64 << 20, description=(
        "the largest response format source compiled at all (a schema's JSON text, a pattern, the choices' "
        "JSON), in bytes: a larger one is refused before compiling"))


class QuestionSection(Section):
    name: str | None = Field(None, pattern=NAME_PATTERN, description="the answer's prompt_name (a column name); "
                                                                     "None = q<index>")
    prompt: str = Field(..., min_length=1, description="the question")
    response_format: ResponseFormatSection | None = Field(None, description="constrain the answer (None = free text)")

    @model_validator(mode="before")
    @classmethod
    def _plain(cls, data: Any) -> Any:
        """A plain string is a free-text question."""
        return {"prompt": data} if isinstance(data, str) else data

    @field_serializer("response_format")
    def _fmt(self, fmt: ResponseFormatSection | None):
        return dump_format(fmt)


def questions_json_schema(schema: dict) -> None:
    """task.questions' JSON schema: each item a string or a `QuestionSection` (validation reads both)."""
    schema["items"] = {"anyOf": [{"type": "string"}, schema["items"]]}


def dump_format(fmt: ResponseFormatSection | None) -> dict | None:
    """A response format as the config gave it (`schema`, not `json_schema`; unset fields left out)."""
    return None if fmt is None else fmt.model_dump(mode="json", by_alias=True, exclude_none=True)


def dump_questions(questions: tuple[QuestionSection, ...]) -> list:
    """task.questions as the config gave them (`dump_question` each)."""
    return [dump_question(q) for q in questions]


def named_questions(questions: tuple[QuestionSection, ...]) -> tuple[QuestionSection, ...]:
    """task.questions' validator: `check_names`, then the questions as they are."""
    check_names(questions)
    return questions


def dump_question(q: QuestionSection) -> str | dict:
    """A question as the config gave it: a plain string stays a string (run ids made before named
    questions existed stay the same)."""
    if q.name is None and q.response_format is None:
        return q.prompt
    return q.model_dump(mode="json", exclude_none=True)


def question_names(questions: tuple[QuestionSection, ...]) -> list[str]:
    """Each question's prompt_name: its `name`, else q<index>."""
    return [q.name or f"q{i}" for i, q in enumerate(questions)]


def check_names(questions: tuple[QuestionSection, ...]) -> None:
    """ValueError naming the first name two questions share (or the caption's reserved name)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(question_names(questions)):
        if name == CAPTION_NAME:
            raise ValueError(f"task.questions.{i}.name: {CAPTION_NAME!r} is the caption's name; choose another")
        if name in seen:
            raise ValueError(f"task.questions.{i}.name: {name!r} is also question {seen[name]}'s name; "
                             "names must be distinct")
        seen[name] = i


# task's fields of these types (pipeline/config/schema.py TaskSection): validated and dumped here
Questions = Annotated[tuple[QuestionSection, ...], AfterValidator(named_questions), PlainSerializer(dump_questions)]
Format = Annotated[ResponseFormatSection | None, PlainSerializer(dump_format)]
