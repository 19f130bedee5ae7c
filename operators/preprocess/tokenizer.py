"""The checkpoint's tokenizer and chat template, without transformers.

`Tokenizer.from_dir(model_dir)` reads `tokenizer.json` with the `tokenizers` library (the
same Rust tokenizer transformers wraps) and the named special tokens and padding side from
`tokenizer_config.json`. For `tokenizer_class: Qwen2Tokenizer` (what Qwen3.5 checkpoints
name) it rebuilds the pipeline as transformers 5 does: that class defines its normaliser
(NFC), pre-tokeniser (the Qwen2 split regex + byte level), decoder and BPE settings in code
and takes only the vocabulary, merges and post-processor from tokenizer.json, so a file
whose own normaliser or pre-tokeniser differ still gives the reference's ids. Any other
named class would need its own code: `load_tokenizer` then falls back to transformers'
AutoTokenizer (same interface, exact by construction, slower to start). Its chat-template rendering
configures jinja2 as transformers'
`apply_chat_template` does (sandboxed, `trim_blocks`, `lstrip_blocks`, `loopcontrols`,
a JSON `tojson`, `raise_exception`, `strftime_now`, a no-op `{% generation %}` block,
the special tokens as variables), so the rendered prompt and the ids equal the
reference's (tests/test_preprocess_processor.py compares both with AutoProcessor).

Why not `AutoTokenizer`: importing transformers and building its tokenizer costs about
2 CPU-s in every preprocessing actor at start-up, which on a small machine delays the
first batch of every job.

Contract (what `PromptEncoder` and `Processor` use, the subset of a transformers tokenizer
they need): `convert_tokens_to_ids`, `unk_token_id`, `pad_token_id`, `added_tokens_decoder`,
`padding_side`, `__call__(text | [text], add_special_tokens)["input_ids"]`, `decode`,
`apply_chat_template(messages, ..., tokenize=False)`.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from vlbatch.operators.errors import ConfigError, SetupError
from vlbatch.operators.storage.named_file import CHECKPOINT_FILE, checkpoint_text

# transformers 5.23 models/qwen2/tokenization_qwen2.py: the pre-tokeniser split of Qwen2Tokenizer
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
AS_FILE_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")  # transformers uses tokenizer.json as is
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases them; templates read the first


def _token_text(value) -> str | None:
    """A special token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(config: dict) -> dict[str, str]:
    """Named special tokens of tokenizer_config.json, as transformers collects them: the standard
    names, then model-specific `*_token` entries (`image_token`, ...) and an
    `extra_special_tokens` dict. All are chat-template variables."""
    named = dict(config)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named.update(extra)
    names = [*SPECIAL_TOKEN_NAMES, *(k for k in named if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES)]
    return {k: text for k in names if (text := _token_text(named.get(k))) is not None}


class Tokenizer:
    """tokenizer.json + tokenizer_config.json of one checkpoint (see the module docstring)."""

    def __init__(self, backend, config: dict, chat_template: str | None = None):
        self.backend = backend  # tokenizers.Tokenizer
        self.padding_side = str(config.get("padding_side", "right"))
        self.special_tokens_map = special_tokens(config)
        self.chat_template = chat_template if chat_template is not None else config.get("chat_template")
        self.added_tokens_decoder = {int(i): t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._templates: dict[str, object] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: dict | None = None) -> Tokenizer:
        """The tokenizer of a checkpoint folder (`config`: its tokenizer_config.json, when already read)."""
        from tokenizers import Tokenizer as Backend

        path = Path(model_dir)
        if not (path / "tokenizer.json").exists():
            raise ConfigError(f"{path} has no tokenizer.json (the fast tokenizer file every Qwen3.5 checkpoint ships)")
        config = read_config(path) if config is None else config
        if config.get("tokenizer_class") not in QWEN2_CLASSES + AS_FILE_CLASSES:
            raise ConfigError(f"tokenizer_class {config.get('tokenizer_class')!r} is not one Tokenizer reproduces; "
                              "use load_tokenizer, which falls back to transformers for it")
        template_file = path / "chat_template.jinja"
        template = checkpoint_text(template_file, CHECKPOINT_FILE) if template_file.exists() else None
        text = checkpoint_text(path / "tokenizer.json", CHECKPOINT_FILE)
        backend = Backend.from_str(text)
        if config.get("tokenizer_class") in QWEN2_CLASSES:
            _as_qwen2_class(backend, json.loads(text)["model"], bool(config.get("add_prefix_space") or False))
        return cls(backend, config, template)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids} for one text, or a list of id lists for a list of texts."""
        if isinstance(text, str):
            return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}
        encs = self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encs]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, tools=None, documents=None, **kwargs) -> str:
        """The prompt string the template renders (only `tokenize=False`: callers tokenise themselves)."""
        if tokenize:
            raise ValueError("Tokenizer.apply_chat_template renders text only; pass tokenize=False")
        template = chat_template or self.chat_template
        if not template:
            raise SetupError("the checkpoint has no chat template (chat_template.jinja or tokenizer_config.json)")
        compiled = self._templates.get(template)
        if compiled is None:
            compiled = self._templates[template] = compile_template(template)
        return compiled.render(messages=[_alias_reasoning(m) for m in messages], tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})


def load_tokenizer(model_dir: str | Path):
    """`Tokenizer.from_dir`, or transformers' AutoTokenizer for a tokenizer class it does not reproduce."""
    path = Path(model_dir)
    config = read_config(path)
    if config.get("tokenizer_class") in QWEN2_CLASSES + AS_FILE_CLASSES:
        return Tokenizer.from_dir(path, config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def read_config(path: Path) -> dict:
    """tokenizer_config.json of a checkpoint folder ({} when absent)."""
    cfg_file = path / "tokenizer_config.json"
    return json.loads(checkpoint_text(cfg_file)) if cfg_file.exists() else {}


def _as_qwen2_class(backend, model: dict, add_prefix_space: bool) -> None:
    """Give `backend` the pipeline transformers' Qwen2Tokenizer builds in code; `model` is
    tokenizer.json's "model" entry (vocabulary and merges)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend.model = BPE(vocab=model["vocab"], merges=merges, dropout=None, unk_token=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
    backend.decoder = decoders.ByteLevel()


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under every name templates read (as transformers passes it)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def compile_template(source: str):
    """A jinja2 template in the environment transformers renders chat templates in."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers uses the tag
        to find assistant tokens for training masks; rendering is unaffected)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's tojson, which escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
