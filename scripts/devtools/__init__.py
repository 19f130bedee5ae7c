"""Developer tools: everything that makes test and demo data, installed as `vlbatch.devtools`.

Never imported by the product path (`vlbatch.operators`, `vlbatch.pipeline`, the `run`
command); the demo, the `make-tiny-checkpoint` command, tests and benchmarks use it
(tests/test_packaging.py checks the product path does not):
- `checkpoints`: tiny random Qwen3.5 checkpoints in the real Hugging Face layout;
- `scenes`: synthetic scenes (images, videos, questions and answers) and their scorer;
- `training`: how the bundled demo model `models/shapes-tiny` was trained on the scenes;
- `samples`, `sample_images`: deterministic good and deliberately bad sample media.
"""
