"""The request fields clients send, through the official ``openai`` client and a real stack: vLLM's
``structured_outputs``, fields that change nothing, unknown fields refused by name, ``logit_bias``, and
the prefix-cache hit in ``usage.prompt_tokens_details``."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.gateway.fields import CHAT_APPLIED, COMPLETION_APPLIED, IGNORED
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from tests.services.stack import MODEL_NAME, Stack, wait_for

pytestmark = pytest.mark.timeout(180)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
# Longer than two KV blocks of 16 tokens in any tokenizer: the second request finds them cached.
LONG_PROMPT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(8))


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def test_every_declared_field_is_on_one_list_and_in_the_docs() -> None:
    assert set(CompletionRequest.model_fields) == COMPLETION_APPLIED | IGNORED
    assert set(ChatCompletionRequest.model_fields) == CHAT_APPLIED | IGNORED
    assert not (COMPLETION_APPLIED | CHAT_APPLIED) & IGNORED
    page = DOCS.read_text()
    for name in COMPLETION_APPLIED | CHAT_APPLIED | IGNORED:
        assert f"`{name}`" in page, name


def test_structured_outputs_choice_is_applied(stack: Stack) -> None:
    client = stack.client()
    choices = ["maybe", "never"]
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        max_tokens=20,
        n=3,
        seed=4,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert [c.message.content in choices for c in resp.choices] == [True] * 3
    comp = client.completions.create(
        model=MODEL_NAME,
        prompt="Code:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}", "disable_fallback": True}},
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", comp.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for form in ({"json": schema}, {"json": json.dumps(schema)}):
        comp = client.completions.create(
            model=MODEL_NAME, prompt="JSON:", max_tokens=40, seed=1, extra_body={"structured_outputs": form}
        )
        if comp.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(comp.choices[0].text)["ok"], bool)
    comp = client.completions.create(
        model=MODEL_NAME,
        prompt="Y:",
        max_tokens=10,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    )
    assert comp.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not supported"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "exactly one of"),
        ({"structured_outputs": {}}, "exactly one of"),
        ({"structured_outputs": {"choices": ["a"]}}, "no field 'choices'"),
        ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}}, "not supported"),
        ({"structured_outputs": {"choice": []}}, "non-empty strings"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "give one of"),
    ],
)
def test_structured_outputs_refused_forms(stack: Stack, extra: dict[str, Any], says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body=extra)
    error = _error(caught.value)
    assert error["param"] in ("structured_outputs", "guided_regex")
    assert says in error["message"]


def test_unknown_field_is_400_naming_it(stack: Stack) -> None:
    client = stack.client()
    for create, kwargs in (
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]}),
        (client.completions.create, {"prompt": "hi"}),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create(model=MODEL_NAME, max_tokens=2, extra_body={"reasoning_effort": "high"}, **kwargs)
        error = _error(caught.value)
        assert (error["param"], error["code"]) == ("reasoning_effort", "unsupported_field")
    # A job's body is held to the same lists.
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "guided_whatever": 1}
    resp = httpx.post(f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_whatever"


def test_fields_that_change_nothing_are_accepted(stack: Stack) -> None:
    client = stack.client()
    kwargs: Any = dict(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    plain = client.chat.completions.create(**kwargs)
    tagged = client.chat.completions.create(
        **kwargs,
        store=True,
        metadata={"team": "a"},
        service_tier="auto",
        user="u-1",
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"},
    )
    assert tagged.choices[0].message.content == plain.choices[0].message.content


def test_logit_bias_decides_the_tokens(stack: Stack) -> None:
    client = stack.client()
    kwargs: Any = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=0)
    free = client.completions.create(**kwargs)
    forced = client.completions.create(**kwargs, logit_bias={"300": 150})  # clamped to 100
    tokens = forced.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1 and tokens != free.choices[0].logprobs.tokens
    for bias, says in (({"abc": 1}, "token ids"), ({"10000000": 1}, "vocabulary size")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**kwargs, logit_bias=bias)
        error = _error(caught.value)
        assert error["param"] == "logit_bias" and says in error["message"]


def test_cached_tokens_show_the_prefix_hit(stack: Stack) -> None:
    client = stack.client()
    prompt = f"{LONG_PROMPT} ({time.time_ns()})"  # a prefix no earlier test left in the cache
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 32
    # LONG_PROMPT is this test's own: nothing in the cache shares even its first block.
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole blocks of 16, all but the one holding the last prompt token (which is always computed).
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1].usage
    assert last is not None and last.prompt_tokens_details is not None
    assert last.prompt_tokens_details.cached_tokens == cached
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    job = httpx.post(
        f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30
    ).json()

    def finished() -> dict[str, Any] | None:
        view: dict[str, Any] = httpx.get(f"{stack.url}/v1/jobs/{job['id']}", timeout=30).json()
        return view if view["status"] == "completed" else None

    view = wait_for(finished, 60, message="the job to finish")
    assert view["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def _check_prompt_logprobs(entries: Any, num_tokens: int, k: int) -> None:
    """vLLM's shape: None first, then token id (str) -> {logprob, rank, decoded_token}, the prompt
    token plus the top k (k + 1 entries, or k when the prompt token is among them)."""
    assert isinstance(entries, list) and len(entries) == num_tokens and entries[0] is None
    for entry in entries[1:]:
        assert k <= len(entry) <= k + 1
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:k] == list(range(1, k + 1))  # the top k, then the prompt token's own (if not in)
        assert all(
            set(e) == {"logprob", "rank", "decoded_token"} and e["logprob"] <= 0 for e in entry.values()
        )
        assert all(int(tok) >= 0 and isinstance(e["decoded_token"], str) for tok, e in entry.items())
        if k:  # the most likely of the entries is the top 1
            assert max(entry.values(), key=lambda e: e["logprob"])["rank"] == 1


def _same_scores(a: list[Any], b: list[Any]) -> None:
    """The same prompt's lists, computed in different batches (float sums may differ in the last bits)."""
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert set(x) == set(y)
        assert all(x[t]["logprob"] == pytest.approx(y[t]["logprob"], abs=1e-3) for t in x)


def test_prompt_logprobs_per_choice(stack: Stack) -> None:
    client = stack.client()
    prompts = ["The capital of France is", "One two three four five six"]
    one = client.completions.create(
        model=MODEL_NAME, prompt=prompts[0], max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    assert one.usage is not None
    _check_prompt_logprobs(one.choices[0].model_extra["prompt_logprobs"], one.usage.prompt_tokens, 2)
    # A batch: each choice carries its own prompt's list (n per prompt).
    batch = client.completions.create(
        model=MODEL_NAME, prompt=prompts, n=2, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    lists = [c.model_extra["prompt_logprobs"] for c in sorted(batch.choices, key=lambda c: c.index)]
    _same_scores(lists[0], one.choices[0].model_extra["prompt_logprobs"])
    _same_scores(lists[1], lists[0])
    _same_scores(lists[3], lists[2])
    assert batch.usage is not None and len(lists[0]) + len(lists[2]) == batch.usage.prompt_tokens
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.usage is not None
    _check_prompt_logprobs(chat.choices[0].model_extra["prompt_logprobs"], chat.usage.prompt_tokens, 0)
    # Out of range: the schema's refusal (422, as for logprobs); with stream: 400.
    refusals: Any = (
        ({"prompt_logprobs": 21}, openai.UnprocessableEntityError, "20"),
        ({"prompt_logprobs": 1, "stream": True}, openai.BadRequestError, "stream"),
    )
    for extra, status_error, says in refusals:
        with pytest.raises(status_error) as caught:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body=extra)
        error = _error(caught.value)
        assert error["param"] == "prompt_logprobs" and says in error["message"]
