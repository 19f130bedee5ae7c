"""A small byte-level BPE tokenizer with Qwen's special tokens.

The vocabulary is trained once, deterministically, on a built-in English corpus
(captioning words, digits, punctuation, timestamps) and stored in
`assets/tokenizer.json`, so every tiny checkpoint and the bundled demo model share
one tokenizer. Pre-tokenisation, normaliser and decoder are Qwen3.5's (NFC,
Qwen's split regex, byte-level), so text is split exactly the way the real
tokenizer splits it; only the merges differ.

Special tokens follow Qwen's order after the regular vocabulary:
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ..., `<|vision_start|>`,
`<|vision_end|>`, `<|vision_pad|>`, `<|image_pad|>`, `<|video_pad|>`, then
`<think>` / `</think>` (added, not special, as in Qwen3.5).
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

ASSET = Path(__file__).parent / "assets" / "tokenizer.json"

# Qwen's split regex (one `\p{N}` per digit, so "<0.2 seconds>" splits per digit).
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added but not "special": they stay in decoded text so thinking can be split off.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

REGULAR_VOCAB_SIZE = 1536

_COLOURS = "red green blue yellow orange purple pink white black gray brown cyan magenta".split()
_SHAPES = "circle circles square squares triangle triangles rectangle star stars shape shapes dot".split()
_WORDS = (
    "a an the one two three four five six seven eight nine ten zero is are there of in on at to and with "
    "small large big tiny medium left right top bottom center middle upper lower corner side background "
    "moving moves move up down toward away changes change colour color from into stays still static "
    "image video picture frame frames scene shows show showing contains containing what which where how "
    "many much count number describe caption question answer yes no it its this that these those "
    "you are a helpful assistant please briefly short sentence seconds second time first last then "
    "slowly quickly fast slow speed direction horizontally vertically diagonally across over under near "
    "far next beside between above below inside outside object objects thing things only also both each "
    "light dark bright pale plain textured striped gradient noise solid"
).split()


def _corpus() -> list[str]:
    """Deterministic training text: sentences over the words above, numbers, timestamps."""
    lines: list[str] = []
    for colour, shape in itertools.product(_COLOURS, _SHAPES):
        lines.append(f"A {colour} {shape} on the left. The {shape} is {colour}.")
        lines.append(f"There are two {colour} {shape}s moving right.")
    for w1, w2 in itertools.product(_WORDS[:60], _WORDS[60:120]):
        lines.append(f"{w1} {w2}, {w2}? {w1}.")
    for i in range(0, 1000, 7):
        lines.append(f"<{i / 10:.1f} seconds> {i} {i % 10} ({i}) [{i}] {i}%")
    lines.append(" ".join(_WORDS))
    lines.append("\n\n Hello! How are you? I'm fine: thanks; -- ok... \"quoted\" 'single' {x}")
    return lines * 3


def build_tokenizer_json(vocab_size: int = REGULAR_VOCAB_SIZE) -> str:
    """Train the BPE and return tokenizer.json text (deterministic for a fixed corpus)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(ADDED_TOKENS)
    return tok.to_str(pretty=True)


def tokenizer_json() -> str:
    """The bundled tokenizer.json text (built and cached on first use if missing)."""
    if not ASSET.exists():
        ASSET.parent.mkdir(parents=True, exist_ok=True)
        ASSET.write_text(build_tokenizer_json())
    return ASSET.read_text()


def special_token_ids() -> dict[str, int]:
    """Map of every special / added token to its id in the bundled tokenizer."""
    data = json.loads(tokenizer_json())
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def tokenizer_config(model_max_length: int = 262144) -> dict:
    """tokenizer_config.json content, shaped like Qwen3.5's."""
    ids = special_token_ids()
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "processor_class": "Qwen3VLProcessor",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
        "extra_special_tokens": {
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
    }
