"""Training of the bundled demo model (`models/shapes-tiny`) on synthetic scenes.

`python -m vlbatch.devtools.training.shapes --out models/shapes-tiny` retrains it (CPU).
Training uses the reference implementation (transformers' Qwen3.5 model and
processor); the saved checkpoint is a plain Hugging Face folder.
"""
