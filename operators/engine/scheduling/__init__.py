"""Scheduling: which sequences run this step and which tokens of each (`scheduler.py`: continuous
batching, chunked prefill, preemption, sibling gating), over `sequence.py` (a request's running
state). Imports `caches/`, never `runner/`."""
