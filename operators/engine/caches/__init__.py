"""What the engine keeps between steps, each bounded by a budget: `block_manager.py` (paged KV
block ids), `state_pool.py` (DeltaNet slots and snapshots), `prefix_cache.py` (radix tree with
hybrid snapshots; `branch_points.py` the prompt keys and where prompts branch), `vision_cache.py`
(features by media hash), `memory.py` (the pools sized from free device memory). The bottom of
the engine: imports nothing from `scheduling/` or `runner/`.

`PREFIX_CACHES` names the ways to store prefixes (`EngineConfig.prefix_cache`; entry-point group
`vlbatch.prefix_caches`): each target a `BudgetedPrefixCache` subclass called as
`target(blocks, block_bytes, budget_bytes, expects)`. A new one: its module and one `Entry`."""
from __future__ import annotations

from vlbatch.operators.registry import Entry, Registry

_PKG = "vlbatch.operators.engine.caches"

PREFIX_CACHES = Registry("prefix cache", "EngineConfig.prefix_cache", "radix", (
    Entry("radix", f"{_PKG}.prefix_cache:RadixPrefixCache",
          "a radix tree of prompt keys with hybrid snapshots"),
    Entry("dict", f"{_PKG}.prefix_cache_naive:DictPrefixCache",
          "a dict of exact prefixes: the naive twin the engine's prefix tests run against"),
), group="vlbatch.prefix_caches")
