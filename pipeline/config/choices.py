"""Job config fields whose values are the names of a `vlbatch.operators.registry.Registry`.

`registry_choice(module, attr)` is the field type: a string that must name an entry of the
registry `module.attr`, read when a config is validated or the schema is generated (so an
entry registered later, as tests do, is accepted and listed). A bad value fails validation
as "<field>: unknown <kind> 'x'; allowed: a, b, c"; the JSON schema gets the choices as its
`enum` and each one's description. `chosen` / `chosen_text` / `choice_problems`: what a
config chooses at every extension point, and whether each can run here (`vlbatch validate`).
"""
from __future__ import annotations

from functools import partial
from types import ModuleType
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.registry import Entry, Here, Registry, check_named


class _FromRegistry:
    """pydantic metadata: validation and JSON schema from `getattr(module, attr)`."""

    def __init__(self, module: ModuleType, attr: str):
        self.module, self.attr = module, attr

    def registry(self) -> Registry:
        return getattr(self.module, self.attr)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        # the check is the registry's own (`Registry.named`), the table read at each validation
        return core_schema.no_info_after_validator_function(partial(check_named, self.module, self.attr),
                                                            handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        out = handler(schema)
        reg = self.registry()
        out["enum"] = list(reg.choices())
        out["description"] = f"{reg.kind} ({reg.field}); {reg.describe()}"
        return out


def registry_choice(module: ModuleType, attr: str) -> Any:
    """The type of a config field naming an entry of the registry `module.attr`."""
    return Annotated[str, _FromRegistry(module, attr)]


def _points() -> list[tuple[ModuleType, str]]:
    """Every extension point a job config chooses from: (module, registry attribute), read when called."""
    from vlbatch.operators import sink
    from vlbatch.operators.kernels import attention, delta_rule, moe
    from vlbatch.operators.media import decoders
    from vlbatch.pipeline.config import formats, model_backends

    return [(model_backends, "MODEL_BACKENDS"), (attention, "ATTENTION"), (delta_rule, "DELTA_RULE"),
            (moe, "MOE"), (decoders, "DECODERS"), (formats, "SOURCES"), (sink, "SINKS")]


def chosen(config: Any) -> list[tuple[Registry, Entry]]:
    """(registry, the entry `config` chooses) for every extension point; `ConfigError` for a
    plugin that vanished since validation (never: validation read the same table)."""
    out = []
    for module, attr in _points():
        reg: Registry = getattr(module, attr)
        value = config
        for part in reg.field.split("."):
            value = getattr(value, part)
        out.append((reg, reg.entry(value)))
    return out


def chosen_text(config: Any) -> str:
    """"field=name" per extension point, a plugin's package named (`vlbatch validate` prints it)."""
    return ", ".join(f"{reg.field}={e.name}{e.origin()}" for reg, e in chosen(config))


def choice_problems(config: Any) -> list[str]:
    """One line per chosen implementation that cannot run on this machine (its registry entry's
    check, judged for `model.device`), or whose plugin does not import (its ConfigError)."""
    here, problems = Here(device=config.model.device), []
    for reg, entry in chosen(config):
        try:
            why = reg.problem(entry.name, here)
        except ConfigError as e:
            problems.append(str(e))
            continue
        if why:
            problems.append(f"{reg.field}: {entry.name} cannot run here: {why}")
    return problems
