"""Prompt preparation has one owner (``engine.inputs.prepare_prompt``): the engine's own API, the core's
pipe and the preparation function refuse a bad prompt with the same typed error, naming the same field."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core.messages import Failure, Reply, client_codec, core_codec
from engine.inputs import (
    ContextLengthError,
    EngineRequest,
    ModelContext,
    PromptError,
    PromptLimits,
    prepare_prompt,
)
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer, load_tokenizer

MAX_LEN = 64
VOCAB = 1024  # the tiny checkpoint's


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> Iterator[LLMEngine]:
    yield LLMEngine.from_engine_args(str(tiny_llama_path), max_model_len=MAX_LEN, num_blocks=32, block_size=8)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Tokenizer:
    tok = load_tokenizer(tiny_llama_path)
    assert tok is not None
    return tok


# (prompt, the error's type, its param, words of its message); max_tokens None, as the engine's API checks.
REFUSED: list[tuple[Any, type[PromptError], str, str]] = [
    ("", PromptError, "prompt", "the prompt is empty"),
    ([], PromptError, "prompt", "the prompt is empty"),
    ([5, VOCAB], PromptError, "prompt", f"must be in [0, {VOCAB})"),
    ([-1, 5], PromptError, "prompt", f"must be in [0, {VOCAB})"),
    (list(range(1, MAX_LEN + 1)), ContextLengthError, "prompt", f"max_model_len) is {MAX_LEN} tokens"),
    ("word " * 200, ContextLengthError, "prompt", "maximum context length"),
]


@pytest.mark.parametrize(("prompt", "kind", "param", "words"), REFUSED, ids=lambda v: repr(v)[:20])
def test_the_engine_api_refuses_as_the_preparation_does(
    engine: LLMEngine, prompt: Any, kind: type[PromptError], param: str, words: str
) -> None:
    with pytest.raises(PromptError) as prepared:
        prepare_prompt(prompt, engine.prompt_limits, engine.tokenizer)
    with pytest.raises(PromptError) as added:
        engine.add_request(EngineRequest("refused", prompt, SamplingParams(max_tokens=1)))
    for exc in (prepared.value, added.value):
        assert type(exc) is kind and exc.param == param and words in str(exc)
    assert str(added.value) == str(prepared.value)
    # Refused before it queued: nothing to step, no block taken.
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.runner.num_blocks
    # A refusal crosses the core's pipe as data and comes back as the same type, naming the same field.
    back = client_codec().decode(core_codec().encode(Reply(1, error=Failure.of(added.value))))
    raised = back.error.exception()
    assert type(raised) is kind and raised.param == param and str(raised) == str(added.value)


def test_the_openai_edges_also_count_max_tokens(tokenizer: Tokenizer) -> None:
    limits = PromptLimits(MAX_LEN, VOCAB)
    ids = list(range(1, MAX_LEN - 3))  # 60 tokens: room for 4 more
    assert prepare_prompt(ids, limits, tokenizer, max_tokens=4) == ids
    with pytest.raises(ContextLengthError) as blamed:
        prepare_prompt(ids, limits, tokenizer, max_tokens=5)
    assert blamed.value.param == "max_tokens"
    # The engine's own API lets such a request run and stops it at the context instead.
    assert prepare_prompt(ids, limits, tokenizer) == ids


def test_text_and_chat_are_encoded_as_the_model_expects(tokenizer: Tokenizer) -> None:
    limits = PromptLimits(MAX_LEN, VOCAB)
    assert prepare_prompt("hi", limits, tokenizer) == tokenizer.encode("hi", add_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    ids = prepare_prompt(None, limits, tokenizer, messages=messages, add_generation_prompt=False)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    with pytest.raises(PromptError, match="no tokenizer") as no_tokenizer:
        prepare_prompt(None, limits, None, messages=messages)
    assert no_tokenizer.value.param == "messages"
    with pytest.raises(PromptError, match="no tokenizer"):
        prepare_prompt("hi", limits, None)
    assert prepare_prompt([3, 4], limits, None) == [3, 4]  # token ids need no tokenizer
    # Limits unknown at this edge (a gateway without the checkpoint): only emptiness is checked.
    assert prepare_prompt([VOCAB * 10] * (MAX_LEN * 2), PromptLimits(None, None), None)


def test_a_template_failure_blames_the_messages(tiny_llama_path: Path, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_llama_path, tmp_path / "model")
    (model / "chat_template.jinja").write_text("{{ raise_exception('tools need a system turn') }}")
    tok = load_tokenizer(model)
    with pytest.raises(PromptError, match="tools need a system turn") as refused:
        prepare_prompt(None, PromptLimits(MAX_LEN, VOCAB), tok, messages=[{"role": "user", "content": "x"}])
    assert refused.value.param == "messages" and "chat template rejected" in str(refused.value)


def test_text_far_too_long_is_refused_without_tokenizing() -> None:
    class NoEncode:  # no token is longer than 4 characters, and tokenizing is not allowed
        vocab_size = 4

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
            return ["abcd" for _ in ids]

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise AssertionError("tokenized a prompt that could not fit")

    with pytest.raises(ContextLengthError) as refused:
        prepare_prompt("x" * (MAX_LEN * 4 + 1), PromptLimits(MAX_LEN, VOCAB), NoEncode())  # type: ignore[arg-type]
    assert refused.value.param == "prompt" and "characters are at least" in str(refused.value)


def test_context_rule_is_the_engine_configs() -> None:
    mistral = {
        "architectures": ["MistralForCausalLM"],
        "max_position_embeddings": 4096,
        "sliding_window": 512,
    }
    # The window bounds what a token attends, not the context: the positions are.
    assert ModelContext.from_config(mistral).max_model_len() == 4096
    assert ModelContext.from_config(mistral).max_model_len(1024) == 1024
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelContext.from_config(mistral).max_model_len(8192)
    qwen = {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 4096, "sliding_window": 512}
    assert ModelContext.from_config(qwen).max_model_len() == 4096  # Qwen2 only with use_sliding_window
    llama = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelContext.from_config(llama).max_model_len(4096)
    scaled = {**llama, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    assert ModelContext.from_config(scaled).max_model_len(8192) == 8192


def test_request_fields_are_checked_where_the_request_is_made() -> None:
    with pytest.raises(ValueError, match="slo_ttft_s must be > 0"):
        EngineRequest("r", [1], slo_ttft_s=0.0)
    with pytest.raises(ValueError, match="not both"):
        EngineRequest("r", [1], resume_token_ids=[2], resume_by_index={0: [2]})


def test_the_short_form_is_the_request(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    short = engine.add_request("short", "hi there", params)
    assert (
        short == engine.add_request(EngineRequest("full", "hi there", params)) == tokenizer.encode("hi there")
    )
    with pytest.raises(TypeError, match="takes no other argument"):
        engine.add_request(EngineRequest("x", [1]), [2])
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert outputs["short"] == outputs["full"] and len(outputs["short"]) == 3
