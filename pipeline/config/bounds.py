"""Bounds on the parsed values of a job config (its YAML, each ``--set`` value) and of a `schema_file`'s JSON:
`size_problem` before any validation walks them, so that neither a few hundred bytes of nested YAML aliases
(10^9 values once expanded), a recursive alias nor deep nesting can take validate's memory or time."""
from __future__ import annotations

MAX_VALUES = 1_000_000  # values, YAML aliases expanded: about what a 1 MiB file (the cap) holds without them
MAX_DEPTH = 64  # levels of nested mappings and lists (a response format's schema included)


def size_problem(data) -> str | None:
    """None when `data` (parsed YAML) holds at most `MAX_VALUES` values, each alias (`*name`) counted as often
    as it appears (a few hundred bytes of nested aliases expand to 10^9 values: validation would never end),
    nests at most `MAX_DEPTH` levels and has no recursive alias; else what is wrong. Time: one visit per
    distinct node (an alias's size is counted once and reused)."""
    sizes: dict[int, int] = {}

    def size(node, depth: int, open_: set[int]) -> int:
        if not isinstance(node, dict | list):
            return 1
        if depth > MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep")
        if id(node) in open_:
            raise _Refused("holds a recursive YAML alias (a node inside itself)")
        if id(node) not in sizes:
            open_.add(id(node))
            sizes[id(node)] = 1 + sum(size(v, depth + 1, open_) for v in (node.values() if isinstance(node, dict)
                                                                          else node))
            open_.discard(id(node))
        return sizes[id(node)]

    try:
        total = size(data, 0, set())
    except _Refused as e:
        return str(e)
    if total > MAX_VALUES:
        return f"holds {total} values once its YAML aliases (*name) are expanded, over the limit of {MAX_VALUES}"
    return None


class _Refused(Exception):
    """`size_problem`'s walk stopped: its message says why."""
