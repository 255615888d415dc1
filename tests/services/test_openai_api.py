"""The official ``openai`` client against the gateway, through Kafka, a worker and Redis."""

from __future__ import annotations

import openai
import pytest

from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(120)

PROMPT = "Once upon a time, in a small village near the sea,"


def test_completion_non_streaming(stack: Stack) -> None:
    resp = stack.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    (choice,) = resp.choices
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_streaming_equals_non_streaming(stack: Stack) -> None:
    client = stack.client()
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_chat_streaming_and_not(stack: Stack) -> None:
    client = stack.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, seed=3)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, seed=3, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Same seed, same prompt: the same sampled text, streamed or not.
    assert text == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 16


def test_n_completions_and_extra_sampling_fields(stack: Stack) -> None:
    resp = stack.client().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        n=2,
        seed=11,
        extra_body={"top_k": 20, "min_p": 0.05, "ignore_eos": True, "priority": 1, "repetition_penalty": 1.1},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 16


def test_logprobs(stack: Stack) -> None:
    resp = stack.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 4
    assert all(v is not None and v <= 0 for v in lp.token_logprobs or [])
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs or [])


def test_models(stack: Stack) -> None:
    models = stack.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_errors_are_openai_shaped(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL_NAME, prompt="word " * 3000, max_tokens=10)
    assert "maximum context length" in too_long.value.message
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=-1)
