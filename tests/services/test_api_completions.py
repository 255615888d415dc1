"""/v1/completions as vLLM's clients use it, through the official ``openai`` client and a real stack:
batched prompts (one choice per prompt and n, numbered prompt by prompt), ``echo``."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]


def _one(client: Any, prompt: Any, **kwargs: Any) -> list[str]:
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, **kwargs)
    return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]


def test_batched_prompts_give_a_choice_per_prompt_and_n(stack: Stack) -> None:
    client = stack.client()
    alone = [_one(client, p, max_tokens=5)[0] for p in PROMPTS]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=5, temperature=0, n=2)
    assert sorted(c.index for c in resp.choices) == list(range(6))
    by_index = {c.index: c.text for c in resp.choices}
    # Choice j of prompt p is choice p * n + j; greedy, so both of a prompt's choices equal its own run.
    assert [by_index[2 * p + j] for p in range(3) for j in range(2)] == [a for a in alone for _ in range(2)]
    assert resp.usage is not None and resp.usage.completion_tokens == 30
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=1) for p in PROMPTS]
    assert resp.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    # Token-id prompts batch the same way.
    ids = [[1, 2, 3, 4], [5, 6, 7]]
    texts = _one(client, ids, max_tokens=3)
    assert texts == [_one(client, one, max_tokens=3)[0] for one in ids]


def test_batched_prompts_stream(stack: Stack) -> None:
    client = stack.client()
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[:2],
            max_tokens=6,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == dict.fromkeys(range(4), "length")
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 24)


def test_echo_prepends_the_prompt(stack: Stack) -> None:
    client = stack.client()
    plain = _one(client, PROMPTS[0], max_tokens=4)[0]
    assert _one(client, PROMPTS[0], max_tokens=4, echo=True) == [PROMPTS[0] + plain]
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[0] + plain
    batched = _one(client, PROMPTS[:2], max_tokens=4, echo=True)
    assert [t[: len(p)] for t, p in zip(batched, PROMPTS[:2], strict=True)] == PROMPTS[:2]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, echo=True, logprobs=1)
    assert caught.value.response.json()["error"]["param"] == "echo"
