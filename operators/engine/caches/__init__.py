"""What the engine keeps between steps, each bounded by a budget: `block_manager.py` (paged KV
block ids), `state_pool.py` (DeltaNet slots and snapshots), `prefix_cache.py` (radix tree with
hybrid snapshots; `branch_points.py` the prompt keys and where prompts branch), `vision_cache.py`
(features by media hash), `memory.py` (the pools sized from free device memory). The bottom of
the engine: imports nothing from `scheduling/` or `runner/`."""
