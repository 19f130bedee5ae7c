"""Our transformers-free `Tokenizer` against transformers' AutoTokenizer on a tiny checkpoint
(the tokenizer files are written in the real Qwen layout by vlbatch.devtools.checkpoints)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from vlbatch.operators.preprocess.tokenizer import Tokenizer

TEXTS = [
    "Describe this image.", "  leading and trailing  ", "Ünïcödé café naïve — 東京タワー 🚀", "tabs\tand\nnewlines\r\n",
    "numbers 1234567 3.14159 -42", "<|im_start|>user\nHi<|im_end|>", "<|vision_start|><|image_pad|><|vision_end|>x",
    "<0.5 seconds>", "e\u0301 (combining accent: NFC folds it)", "", "a" * 300,
]


@pytest.fixture(scope="module")
def toks(tiny_ckpt):
    path = tiny_ckpt("dense")
    return AutoTokenizer.from_pretrained(str(path)), Tokenizer.from_dir(path)


@pytest.mark.parametrize("special", [False, True])
def test_ids_match_reference(toks, special):
    ref, ours = toks
    want = [ref(t, add_special_tokens=special)["input_ids"] for t in TEXTS]
    assert ours(TEXTS, add_special_tokens=special)["input_ids"] == want
    assert [ours(t, add_special_tokens=special)["input_ids"] for t in TEXTS] == want


def test_special_tokens_and_padding_side_match_reference(toks):
    ref, ours = toks
    assert ours.special_tokens_map == ref.special_tokens_map
    assert (ours.pad_token_id, ours.eos_token_id, ours.unk_token_id) == (ref.pad_token_id, ref.eos_token_id,
                                                                         ref.unk_token_id)
    assert ours.padding_side == ref.padding_side
    assert ours.added_tokens_decoder == {i: t.content for i, t in ref.added_tokens_decoder.items()}
    assert ours.convert_tokens_to_ids("<|video_pad|>") == ref.convert_tokens_to_ids("<|video_pad|>")
    assert ours.convert_tokens_to_ids("no-such-token-here") is None


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_reference(toks, skip):
    ref, ours = toks
    for t in TEXTS:
        ids = ref(t, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_reasoning_history_renders_as_reference(toks):
    """An earlier assistant turn with its reasoning under each name transformers accepts."""
    ref, ours = toks
    for field in ("reasoning_content", "thinking", "reasoning"):
        msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", field: "add them"},
                {"role": "user", "content": "and 3+3?"}]
        for thinking in (False, True):
            kw = dict(add_generation_prompt=True, enable_thinking=thinking)
            assert ours.apply_chat_template(msgs, **kw) == ref.apply_chat_template(msgs, tokenize=False, **kw)


def test_template_features_of_the_transformers_environment(toks):
    _, ours = toks
    tpl = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
           "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}{{ eos_token }}")
    out = ours.apply_chat_template([{"role": "user", "content": "é<b>"}, {"role": "x"}], chat_template=tpl)
    assert out == '{"role": "user", "content": "é<b>"}<|im_end|>'  # no HTML escaping, no ASCII escaping
    with pytest.raises(Exception, match="no system"):
        ours.apply_chat_template([], chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(ValueError, match="tokenize=False"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)


def _variant(src, dst, edit_json, edit_config=None):
    import json
    import shutil

    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    edit_json(tj)
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    if edit_config:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        edit_config(cfg)
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_qwen2_class_pipeline_comes_from_code_as_in_transformers(tiny_ckpt, tmp_path):
    """transformers builds Qwen2Tokenizer's normaliser / pre-tokeniser in code and takes only the
    vocabulary, merges and post-processor from tokenizer.json: a file whose pipeline differs
    must still give the reference's ids (loading the file as is would not)."""
    from tokenizers import Tokenizer as Backend

    def edit(tj):
        tj["normalizer"] = None  # no NFC
        tj["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}

    path = _variant(tiny_ckpt("dense"), tmp_path / "ckpt", edit)
    ref, ours = AutoTokenizer.from_pretrained(str(path)), Tokenizer.from_dir(path)
    want = [ref(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert ours(TEXTS, add_special_tokens=False)["input_ids"] == want
    as_file = Backend.from_file(str(path / "tokenizer.json"))
    assert [e.ids for e in as_file.encode_batch(TEXTS, add_special_tokens=False)] != want  # the test can fail


def test_other_tokenizer_classes_fall_back_to_transformers(tiny_ckpt, tmp_path):
    from vlbatch.operators.errors import ConfigError
    from vlbatch.operators.preprocess.tokenizer import load_tokenizer

    path = _variant(tiny_ckpt("dense"), tmp_path / "ckpt", lambda tj: None,
                    lambda cfg: cfg.update(tokenizer_class="GPT2Tokenizer"))
    with pytest.raises(ConfigError, match="GPT2Tokenizer"):
        Tokenizer.from_dir(path)
    tok = load_tokenizer(path)
    assert not isinstance(tok, Tokenizer)
    ref = AutoTokenizer.from_pretrained(str(path))
    assert tok(TEXTS, add_special_tokens=True)["input_ids"] == ref(TEXTS, add_special_tokens=True)["input_ids"]
