"""engine.tokenizer against HF transformers' reading of the same checkpoint files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer

from engine.models.tiny import write_tiny_checkpoint
from engine.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces and\ttabs\nnew lines",
    "你好，世界！ 龍 🦀🚀 café naïve",
    "<|im_start|>user\nhi<|im_end|>",
    "a </s> in the middle",
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]},
]


@pytest.fixture(scope="module")
def tok(tiny_llama_path: Path) -> Tokenizer:
    loaded = load_tokenizer(tiny_llama_path)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def hf(tiny_llama_path: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Tokenizer:
    """Copy checkpoint ``src`` to ``dst`` (unless the same), update its tokenizer_config.json, load."""
    if src != dst:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(dst)
    assert tok is not None
    return tok


def test_no_tokenizer_json_gives_none(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, with_tokenizer=False)
    assert (path / "config.json").is_file()
    assert load_tokenizer(path) is None


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_hf(tok: Tokenizer, hf, add_special_tokens: bool) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        expected = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_bos_added_exactly_once(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id == 0
    assert ids.count(0) == 1
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(tok: Tokenizer, hf, skip: bool) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    # Round trip: byte-level BPE is lossless on any text without special tokens.
    plain = TEXTS[4]
    assert tok.decode(tok.encode(plain)) == plain


def test_special_ids_and_vocab(tok: Tokenizer, hf, tiny_llama_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert tok.bos_token_id == hf.bos_token_id == 0
    assert tok.eos_token_id == hf.eos_token_id == 1
    # generation_config.json lists ChatML's end of turn as a second eos.
    assert tok.eos_token_ids == (1, 3)
    assert tok.all_special_ids == set(hf.all_special_ids) == {0, 1, 2, 3}
    config = json.loads((tiny_llama_path / "config.json").read_text())
    assert tok.vocab_size == len(hf) == config["vocab_size"]
    assert tok.model_max_length == config["max_position_embeddings"]


def test_convert_ids_to_tokens(tok: Tokenizer, hf) -> None:  # type: ignore[no-untyped-def]
    ids = tok.encode(TEXTS[2] + TEXTS[4])
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens([tok.vocab_size + 5]) == [None]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok: Tokenizer, hf, add_generation_prompt: bool) -> None:  # type: ignore[no-untyped-def]
    assert tok.has_chat_template
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<s><|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    # The rendered text carries bos already.
    ids = tok.encode(ours, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(ids[0]) == 1


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])


def test_chat_template_is_sandboxed(tiny_llama_path: Path, tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = _copy_with_config(tiny_llama_path, tmp_path, chat_template=template)
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES)


def test_plain_fallback_without_template(tiny_llama_path: Path, tmp_path: Path) -> None:
    tok = _copy_with_config(tiny_llama_path, tmp_path, chat_template=None)
    assert not tok.has_chat_template
    text = tok.apply_chat_template(MESSAGES[:2])
    assert text == "<s>system: You are terse.\nuser: What is 2 + 2?\nassistant:"
    assert tok.apply_chat_template(MESSAGES[3:], add_generation_prompt=False) == "<s>user: And 3 + 3?"


def test_post_processor_decides_over_flags(tiny_llama_path: Path, tmp_path: Path) -> None:
    # tokenizer.json's post-processor adds bos; as in HF transformers 5 it wins over the flags.
    tok = _copy_with_config(tiny_llama_path, tmp_path, add_bos_token=False, add_eos_token=True)
    expected = AutoTokenizer.from_pretrained(tmp_path)("Hello world")["input_ids"]
    assert tok.encode("Hello world") == expected
    assert expected[0] == tok.bos_token_id and expected[-1] != tok.eos_token_id


@pytest.mark.parametrize(("add_bos", "add_eos"), [(True, False), (False, True), (True, True), (False, False)])
def test_flags_decide_without_post_processor(
    tiny_llama_path: Path, tmp_path: Path, add_bos: bool, add_eos: bool
) -> None:
    shutil.copytree(tiny_llama_path, tmp_path, dirs_exist_ok=True)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    tj["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    tok = _copy_with_config(tmp_path, tmp_path, add_bos_token=add_bos, add_eos_token=add_eos)
    body = tok.encode("Hello world", add_special_tokens=False)
    assert body and tok.bos_token_id not in body
    expected = [tok.bos_token_id] * add_bos + body + [tok.eos_token_id] * add_eos
    assert tok.encode("Hello world") == expected
    # The plain chat fallback starts with bos exactly when encode adds one.
    no_template = _copy_with_config(tmp_path, tmp_path / "plain", chat_template=None, add_bos_token=add_bos)
    assert no_template.apply_chat_template(MESSAGES[1:2]).startswith("<s>") == add_bos


def test_eos_from_generation_config_when_tokenizer_config_has_none(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    shutil.copytree(tiny_llama_path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer_config.json").unlink()
    tok = load_tokenizer(tmp_path)
    assert tok is not None
    assert tok.eos_token_id == 1 and tok.eos_token_ids == (1, 3)
    assert tok.bos_token_id == 0  # from generation_config.json / config.json
    assert not tok.has_chat_template
    assert tok.model_max_length is None


def test_module_does_not_import_torch(tiny_llama_path: Path) -> None:
    code = (
        "import sys; from engine.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tiny_llama_path)!r}); t.encode('hi'); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_template_file_wins_and_template_helpers(tiny_llama_path: Path, tmp_path: Path) -> None:
    # chat_template.jinja beats tokenizer_config.json; tojson is plain JSON; loop controls work.
    shutil.copytree(tiny_llama_path, tmp_path, dirs_exist_ok=True)
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(tmp_path)
    assert tok is not None
    messages = [{"role": "user", "content": "<b>é</b> & co"}, {"role": "user", "content": "unseen"}]
    assert tok.apply_chat_template(messages) == '"<b>é</b> & co"</s>'
