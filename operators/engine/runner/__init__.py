"""The model runner: a step plan in, logits out (`model_runner.py`: inputs, vision features,
paged attention, the model's `forward_packed`; `static_decode.py`: decode steps padded to batch
buckets, CUDA graphs on CUDA; `step_cache.py`: the model's view of the paged K/V and pooled
states). Imports `scheduling/` (the `StepPlan`) and `caches/`."""
