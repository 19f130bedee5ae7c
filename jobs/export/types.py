"""Arrow types of structured answers for `vlbatch export --layout media` (`jobs/export/media.py`).

`prompt_type(fmt)`: a prompt's response format (`pipeline/config/answers.py`) -> `Typed` (its Arrow type
and the check that turns a parsed JSON value into a value of that type):

- free text (no format) and regex -> string; choice -> dictionary<int32, string>;
- json_schema, recursively: object with `properties` -> struct (one field per property, sorted by name:
  the run's fingerprint records the schema with sorted keys, so a config and a fingerprint give one
  order; an absent property is null, others are dropped), array with `items` -> list of the item type,
  string -> string, an `enum` (or `const`) of strings -> dictionary<int32, string>, of integers -> int64,
  integer -> int64, number -> float64, boolean -> bool_, `type: [X, "null"]` -> X; a local `$ref`
  (`#/$defs/..`, `#/definitions/..`) is followed. Anything else (anyOf / oneOf, an object without
  properties, an array without items, a recursive $ref) -> JSON text (Arrow's JSON extension type
  where pyarrow has it, as the rows' `parsed` column).

A check raises `Misfit` when a value does not fit its type (the engine's grammar makes an ok row's value
fit; the export is safe anyway: that prompt's cell is null and its status `error`).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from vlbatch.operators.sink.schema import PARSED_TYPE

DICT_STRING = pa.dictionary(pa.int32(), pa.string())
MAX_DEPTH = 32  # nesting (and $ref hops) followed before a sub-schema is kept as JSON text
INT64 = (-(1 << 63), (1 << 63) - 1)


class Misfit(ValueError):
    """A value that does not fit its prompt's Arrow type."""


@dataclass(frozen=True)
class Typed:
    type: pa.DataType
    check: Callable[[Any], Any]  # parsed JSON value -> the value pa.array takes for `type` (Misfit if not)


def _string(v: Any) -> str:
    if not isinstance(v, str):
        raise Misfit(f"expected a string, got {type(v).__name__}")
    return v


def _int(v: Any) -> int:
    if isinstance(v, float) and v.is_integer():  # JSON Schema: 1.0 is an integer
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not INT64[0] <= v <= INT64[1]:
        raise Misfit(f"expected an int64 integer, got {v!r:.40}")
    return v


def _float(v: Any) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise Misfit(f"expected a number, got {v!r:.40}")
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Misfit(f"expected a boolean, got {v!r:.40}")
    return v


def _json_text(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, sort_keys=True)


JSON_TEXT = Typed(PARSED_TYPE, _json_text)
FREE_TEXT = Typed(pa.string(), _string)


def _one_of(values: tuple[str, ...]) -> Typed:
    allowed = frozenset(values)

    def check(v: Any) -> str:
        if v not in allowed or not isinstance(v, str):
            raise Misfit(f"{v!r:.40} is not one of the choices")
        return v

    return Typed(DICT_STRING, check)


def _list(item: Typed) -> Typed:
    def check(v: Any) -> list:
        if not isinstance(v, list):
            raise Misfit(f"expected an array, got {type(v).__name__}")
        return [None if x is None else item.check(x) for x in v]

    return Typed(pa.list_(item.type), check)


def _struct(props: dict[str, Typed]) -> Typed:
    def check(v: Any) -> dict:
        if not isinstance(v, dict):
            raise Misfit(f"expected an object, got {type(v).__name__}")
        return {k: None if v.get(k) is None else t.check(v[k]) for k, t in props.items()}

    return Typed(pa.struct([pa.field(k, t.type) for k, t in props.items()]), check)


def prompt_type(fmt) -> Typed:
    """A prompt's `ResponseFormatSection` (None: free text) -> its `Typed`."""
    if fmt is None or fmt.type == "regex":
        return FREE_TEXT
    if fmt.type == "choice":
        return _one_of(tuple(fmt.choices))
    return schema_type(fmt.json_schema)


def schema_type(schema: Any, root: Any = None, depth: int = 0) -> Typed:
    """A JSON Schema (sub-)schema -> `Typed` (module docstring); `root`: the document $refs point into."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return JSON_TEXT
    if isinstance(schema.get("$ref"), str):
        return schema_type(_ref(root, schema["$ref"]), root, depth + 1)
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values is not None:
        return _enum_type(values)
    kind = _kind(schema)
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return _struct({k: schema_type(s, root, depth + 1) for k, s in sorted(schema["properties"].items())})
    if kind == "array" and isinstance(schema.get("items"), dict):
        return _list(schema_type(schema["items"], root, depth + 1))
    simple = {"string": FREE_TEXT, "integer": Typed(pa.int64(), _int), "number": Typed(pa.float64(), _float),
              "boolean": Typed(pa.bool_(), _bool)}
    return simple.get(kind, JSON_TEXT)


def _kind(schema: dict) -> str | None:
    """The schema's one non-null `type` (from properties / items when absent); None: a combinator, several, none."""
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "not")):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        t = rest[0] if len(rest) == 1 else None
    elif t is None:
        t = "object" if "properties" in schema else "array" if "items" in schema else None
    return t if isinstance(t, str) else None


def _enum_type(values: list) -> Typed:
    if values and all(isinstance(v, str) for v in values):
        return _one_of(tuple(values))
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        allowed = frozenset(values)

        def check(v: Any) -> int:
            if _int(v) not in allowed:
                raise Misfit(f"{v!r:.40} is not in the enum")
            return int(v)

        return Typed(pa.int64(), check)
    return JSON_TEXT


def _ref(root: Any, ref: str) -> Any:
    """A local JSON pointer (`#/$defs/x`) into `root`; None (-> JSON text) for any other reference."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
