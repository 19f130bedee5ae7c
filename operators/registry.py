"""Named implementations of one extension point: the one place that says which exist.

Each extension point (video decoders, model backends, model architectures, attention / delta
rule / MoE kernels, prefix caches, input sources, output sinks) has one `Registry` constant
beside its contract: a table of `Entry(name, target, description, check)`. `target` is
`"package.module:attr"` (or `"package.module:Class.method"`), imported only when that entry is
chosen, so an optional backend (Triton, fla) that is absent never breaks an import, and reading
the table (the job config's choices, its JSON schema) imports no torch or Ray. `check`, when
given, names a function `(here: Here) -> str | None`: whether the entry can run on this machine
(TorchCodec without FFmpeg, decord not installed), one line saying what is missing.

Out-of-tree implementations: a registry with a `group` also lists the Python entry points of
that group (`importlib.metadata`, e.g. `vlbatch.decoders`; a package declares
`fake = my_pkg.module:MyDecoder` in its entry_points.txt), read each time the table is read
(never at import). A plugin is imported when chosen or checked; one that cannot be imported,
or whose name is malformed or taken, is a `ConfigError` naming it and its package. A plugin's
target may carry a `problem(here) -> str | None` attribute, its own check.

What a target is called with is the extension point's own contract (its `base.py`); the
registry only names, describes, checks and imports. A registry is immutable: adding an
implementation is its module plus one `Entry` in the table; `with_entry` makes a new
registry (tests register an implementation that way, on the package attribute, and the job
config's validation and schema see it, since they read the attribute when they run).
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass
from typing import Any

from vlbatch.operators.errors import ConfigError, SetupError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Here:
    """What an entry's check judges: this machine, and the job's `model.device` (cpu, cuda, auto)."""

    device: str = "auto"


def _import(target: str) -> Any:
    module, _, attrs = target.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


@dataclass(frozen=True)
class Entry:
    """One implementation: `name` (what a job config says), `target` ("module:attr" or
    "module:Class.method"), a one-line `description` (config docs, schema, errors), `check`
    ("module:function" of `Here` -> problem line or None; None: usable wherever vlbatch runs),
    `plugin` (the package an entry point came from; None for vlbatch's own)."""

    name: str
    target: str
    description: str
    check: str | None = None
    plugin: str | None = None

    def load(self) -> Any:
        """Import the target's module and return the attribute (the first use imports the backend)."""
        return _import(self.target)

    def origin(self) -> str:
        """" (plugin <package>)" for a plugin's entry, "" for vlbatch's own (validate's output)."""
        return f" (plugin {self.plugin})" if self.plugin else ""


def check_named(module: Any, attr: str, name: str) -> str:
    """`getattr(module, attr).named(name)`: the registry read at each call, so an entry registered (or a table
    replaced) after the config type was made is seen (`pipeline/config/choices.registry_choice`)."""
    return getattr(module, attr).named(name)


@dataclass(frozen=True)
class Registry:
    """The implementations of one extension point. `kind` names it in messages ("attention
    kernel"); `field` is the job config field that chooses it ("model.engine.attention");
    `default` is the entry chosen when the config does not say; `group` the entry-point group
    plugins register in ("vlbatch.decoders"; None: no plugins)."""

    kind: str
    field: str
    default: str
    entries: tuple[Entry, ...]
    group: str | None = None

    def __post_init__(self):
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names) or self.default not in names:
            raise ValueError(f"{self.kind} registry: names must be unique and hold the default {self.default!r}: "
                             f"{names}")  # a programming error in a table, not user input

    def plugins(self) -> tuple[Entry, ...]:
        """The entry points of `group` installed now, as entries (nothing imported)."""
        if self.group is None:
            return ()
        from importlib.metadata import entry_points

        own, out = self.entries_by_name(), {}
        for ep in sorted(entry_points(group=self.group), key=lambda ep: ep.name):
            dist = ep.dist.name if ep.dist is not None else "an unnamed package"
            where = f"the plugin {ep.name!r} (entry point {self.group}, package {dist})"
            if not _NAME.fullmatch(ep.name) or ":" not in ep.value:
                raise ConfigError(f"{self.field}: {where} is malformed: expected name = package.module:attr, "
                                  f"got {ep.value!r}")
            if ep.name in own or ep.name in out:
                taken = "vlbatch's own" if ep.name in own else f"the package {out[ep.name].plugin}'s"
                raise ConfigError(f"{self.field}: {where} takes the name of {taken} {self.kind}; "
                                  "rename it or uninstall one of them")
            out[ep.name] = Entry(ep.name, ep.value, f"from the package {dist}", plugin=dist)
        return tuple(out.values())

    def entries_by_name(self) -> dict[str, Entry]:
        """vlbatch's own entries by name (no plugin read)."""
        return {e.name: e for e in self.entries}

    def all(self) -> tuple[Entry, ...]:
        """vlbatch's entries, then the plugins' (by name)."""
        return (*self.entries, *self.plugins())

    def choices(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.all())

    def describe(self) -> str:
        """"name: description" per entry, in table order (the config field's documentation)."""
        return "; ".join(f"{e.name}: {e.description}" for e in self.all())

    def unknown(self, name: object) -> str:
        """The message for a name not in the table (without the field: pydantic adds it)."""
        return f"unknown {self.kind} {name!r}; allowed: {', '.join(self.choices())}"

    def named(self, name: str) -> str:
        """`name` when it is an entry's (a config field's validator), else `ValueError(unknown(name))`."""
        if name not in self.choices():
            raise ValueError(self.unknown(name))
        return name

    def entry(self, name: str) -> Entry:
        """The entry called `name`; `ConfigError` naming the field and listing the choices otherwise."""
        for e in (*self.entries, *(self.plugins() if name not in self.entries_by_name() else ())):
            if e.name == name:
                return e
        raise ConfigError(f"{self.field}: {self.unknown(name)}")

    def load(self, name: str) -> Any:
        """The target of `name`, imported (see `Entry.load`); a backend whose package is not
        installed here is a `SetupError` naming the field; a plugin that does not import is a
        `ConfigError` naming it and its package."""
        entry = self.entry(name)
        try:
            return entry.load()
        except Exception as e:
            if entry.plugin is not None:
                raise ConfigError(f"{self.field}: the plugin {name!r} (entry point {self.group}, package "
                                  f"{entry.plugin}) cannot be loaded: {type(e).__name__}: {e}") from None
            if isinstance(e, ModuleNotFoundError):
                raise SetupError(f"{self.field}={name}: {e.name or e} is not installed here "
                                 f"(choose another of: {', '.join(self.choices())})") from None
            raise

    def problem(self, name: str, here: Here | None = None) -> str | None:
        """Why `name` cannot run here (one line), or None: its `check`; a plugin's target's own
        `problem(here)` if it has one (a plugin that does not import: `ConfigError`, from `load`)."""
        entry, here = self.entry(name), here or Here()
        if entry.plugin is not None:
            check = getattr(self.load(name), "problem", None)
            return check(here) if callable(check) else None
        return _import(entry.check)(here) if entry.check else None

    def with_entry(self, entry: Entry) -> Registry:
        """A new registry with `entry` added (or replacing the entry of its name)."""
        kept = tuple(e for e in self.entries if e.name != entry.name)
        return dataclasses.replace(self, entries=(*kept, entry))
