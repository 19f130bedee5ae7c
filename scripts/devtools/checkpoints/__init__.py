"""Tiny Qwen3.5 checkpoints in the real Hugging Face layout (tests, demo, benchmarks).

`make_tiny_checkpoint(out_dir, variant=...)` writes config.json, safetensors weights
(optionally sharded with model.safetensors.index.json), generation_config.json, the
tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja) and the
processor configs (preprocessor_config.json, video_preprocessor_config.json) so the
result loads through exactly the code path a real Qwen3.5 checkpoint goes through.
"""
from vlbatch.devtools.checkpoints.tiny import TINY_VARIANTS, make_tiny_checkpoint

__all__ = ["TINY_VARIANTS", "make_tiny_checkpoint"]
