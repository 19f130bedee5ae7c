"""Named implementations of one extension point: the one place that says which exist.

Each extension point (attention, delta rule and MoE kernels, output sinks, input sources) has
one `Registry` constant beside its contract (its package's `__init__.py`): a table of
`Entry(name, target, description)`. `target` is `"package.module:attr"` (or
`"package.module:Class.method"`), imported only when that entry is chosen, so an optional
backend (Triton, fla) that is absent never breaks an import, and reading the table (the
job config's choices, its JSON schema) imports no torch or Ray.

What a target is called with is the extension point's own contract (its `base.py`); the
registry only names, describes and imports. A registry is immutable: adding an
implementation is its module plus one `Entry` in the table; `with_entry` makes a new
registry (tests register an implementation that way, on the package attribute, and the job
config's validation and schema see it, since they read the attribute when they run).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from vlbatch.operators.errors import ConfigError, SetupError


@dataclass(frozen=True)
class Entry:
    """One implementation: `name` (what a job config says), `target` ("module:attr" or
    "module:Class.method"), a one-line `description` (config docs, schema, errors)."""

    name: str
    target: str
    description: str

    def load(self) -> Any:
        """Import the target's module and return the attribute (the first use imports the backend)."""
        module, _, attrs = self.target.partition(":")
        obj: Any = importlib.import_module(module)
        for attr in attrs.split("."):
            obj = getattr(obj, attr)
        return obj


@dataclass(frozen=True)
class Registry:
    """The implementations of one extension point. `kind` names it in messages ("attention
    kernel"); `field` is the job config field that chooses it ("model.engine.attention");
    `default` is the entry chosen when the config does not say."""

    kind: str
    field: str
    default: str
    entries: tuple[Entry, ...]

    def __post_init__(self):
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names) or self.default not in names:
            raise ValueError(f"{self.kind} registry: names must be unique and hold the default {self.default!r}: "
                             f"{names}")  # a programming error in a table, not user input

    def choices(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def describe(self) -> str:
        """"name: description" per entry, in table order (the config field's documentation)."""
        return "; ".join(f"{e.name}: {e.description}" for e in self.entries)

    def unknown(self, name: object) -> str:
        """The message for a name not in the table (without the field: pydantic adds it)."""
        return f"unknown {self.kind} {name!r}; allowed: {', '.join(self.choices())}"

    def entry(self, name: str) -> Entry:
        """The entry called `name`; `ConfigError` naming the field and listing the choices otherwise."""
        for e in self.entries:
            if e.name == name:
                return e
        raise ConfigError(f"{self.field}: {self.unknown(name)}")

    def load(self, name: str) -> Any:
        """The target of `name`, imported (see `Entry.load`); a backend whose package is not
        installed here is a `SetupError` naming the field."""
        entry = self.entry(name)
        try:
            return entry.load()
        except ModuleNotFoundError as e:
            raise SetupError(f"{self.field}={name}: {e.name or e} is not installed here "
                             f"(choose another of: {', '.join(self.choices())})") from None

    def with_entry(self, entry: Entry) -> Registry:
        """A new registry with `entry` added (or replacing the entry of its name)."""
        kept = tuple(e for e in self.entries if e.name != entry.name)
        return dataclasses.replace(self, entries=(*kept, entry))
