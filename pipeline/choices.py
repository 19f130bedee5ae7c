"""Job config fields whose values are the names of a `vlbatch.operators.registry.Registry`.

`registry_choice(module, attr)` is the field type: a string that must name an entry of the
registry `module.attr`, read when a config is validated or the schema is generated (so an
entry registered later, as tests do, is accepted and listed). A bad value fails validation
as "<field>: unknown <kind> 'x'; allowed: a, b, c"; the JSON schema gets the choices as its
`enum` and each one's description.
"""
from __future__ import annotations

from types import ModuleType
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

from vlbatch.operators.registry import Registry


class _FromRegistry:
    """pydantic metadata: validation and JSON schema from `getattr(module, attr)`."""

    def __init__(self, module: ModuleType, attr: str):
        self.module, self.attr = module, attr

    def registry(self) -> Registry:
        return getattr(self.module, self.attr)

    def check(self, value: str) -> str:
        reg = self.registry()
        if value not in reg.choices():
            raise ValueError(reg.unknown(value))
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        out = handler(schema)
        reg = self.registry()
        out["enum"] = list(reg.choices())
        out["description"] = f"{reg.kind} ({reg.field}); {reg.describe()}"
        return out


def registry_choice(module: ModuleType, attr: str) -> Any:
    """The type of a config field naming an entry of the registry `module.attr`."""
    return Annotated[str, _FromRegistry(module, attr)]
