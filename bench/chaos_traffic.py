"""The soak's clients: seeded requests of every kind, each classified by what its client saw.

Kinds: a stream (SSE), a plain completion, a chat completion, a job (polled), a job cancelled soon
after it is created, and hostile bodies (must be refused with a 4xx). Every request is greedy or
seeded, so an undisturbed run gives the text it must end with.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

KINDS = ("stream", "plain", "chat", "job", "cancel")
# Hostile bodies: each must get a 4xx (or a typed error) and harm nothing else. The long prompts are past
# any context the tiny checkpoints have (4096 at most); the oversize body is past the gateway's default
# INFLIGHT_MAX_BODY_BYTES (4 MiB).
CONTEXT_PAST = 5000
OVERSIZE_BYTES = 4 * 1024 * 1024 + 64 * 1024


def poison_bodies(model: str) -> list[tuple[str, bytes]]:
    """(label, raw body) of every kind of poison the soak mixes in."""
    words = " ".join(("one", "two", "three", "four")[i % 4] for i in range(2 * CONTEXT_PAST))
    dumps, name = json.dumps, model.encode()
    return [
        ("lone surrogate", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 1}' % name),
        ("negative token id", dumps({"model": model, "prompt": [[-1]], "max_tokens": 1}).encode()),
        (
            "lone surrogate, chat",
            b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % name,
        ),
        ("overlong stop", dumps({"model": model, "prompt": "x", "stop": ["ab" * 600]}).encode()),
        (
            "token ids past the context",
            dumps(
                {"model": model, "prompt": [1 + i % 900 for i in range(CONTEXT_PAST)], "max_tokens": 4}
            ).encode(),
        ),
        ("text past the context", dumps({"model": model, "prompt": words, "max_tokens": 4}).encode()),
        ("negative temperature", dumps({"model": model, "prompt": "x", "temperature": -1}).encode()),
        ("top_p over 1", dumps({"model": model, "prompt": "x", "top_p": 1.5, "stream": True}).encode()),
        ("n of 0", dumps({"model": model, "prompt": "x", "n": 0}).encode()),
        ("max_tokens a string", dumps({"model": model, "prompt": "x", "max_tokens": "many"}).encode()),
        ("oversize body", dumps({"model": model, "prompt": "x" * OVERSIZE_BYTES, "max_tokens": 1}).encode()),
    ]


@dataclass
class Spec:
    index: int
    kind: str  # one of KINDS, or "hostile"
    body: dict[str, Any]
    at_s: float  # when to send, from the start of the fault phase
    raw: bytes = b""  # hostile bodies are sent as they are
    label: str = ""  # which hostile body


@dataclass
class Result:
    spec: Spec
    outcome: str = "lost"  # completed | failed | cancelled | refused | rejected | server_error | lost
    request_id: str | None = None
    text: str | None = None
    detail: str = ""
    sent_to: str = ""
    latency_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def make_specs(seed: int, num_requests: int, duration_s: float, model: str) -> list[Spec]:
    rng = random.Random(seed)
    poison = poison_bodies(model)
    specs: list[Spec] = []
    for i in range(num_requests):
        at = rng.uniform(0, duration_s)
        if rng.random() < 0.15:
            label, raw = poison[sum(s.kind == "hostile" for s in specs) % len(poison)]  # each kind in turn
            specs.append(Spec(i, "hostile", {}, at, raw, label))
            continue
        kind = rng.choice(KINDS)
        prompt = f"request {i}: " + " ".join(
            rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(6)
        )
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(8, 40), "ignore_eos": True}
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body |= {"temperature": 0.8, "seed": rng.randint(0, 2**31)}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        specs.append(Spec(i, kind, body, at))
    return sorted(specs, key=lambda s: s.at_s)


def reference_body(spec: Spec) -> tuple[str, dict[str, Any]]:
    path = "/v1/chat/completions" if spec.kind == "chat" else "/v1/completions"
    return path, spec.body


def text_of_response(obj: dict[str, Any]) -> str:
    choice = obj["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def run_one(spec: Spec, gateways: list[str], rng: random.Random, deadline_s: float) -> Result:
    """Send one request to a gateway picked at random (a client that knows two addresses)."""
    url = rng.choice(gateways)
    result = Result(spec, sent_to=url)
    began = time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(deadline_s, connect=5.0)) as http:
            if spec.kind == "hostile":
                resp = http.post("/v1/completions" if b'"prompt"' in spec.raw else "/v1/chat/completions",
                                 content=spec.raw, headers={"Content-Type": "application/json"})  # fmt: skip
                result.outcome = "rejected" if 400 <= resp.status_code < 500 else "server_error"
                result.detail = str(resp.status_code)
            elif spec.kind == "stream":
                _stream(http, spec, result)
            elif spec.kind in ("plain", "chat"):
                path, body = reference_body(spec)
                resp = http.post(path, json=body)
                _plain(resp, result)
            else:
                _job(http, spec, result, deadline_s, gateways)
    except httpx.TimeoutException as exc:
        result.outcome, result.detail = "lost", f"no answer in time: {exc!r}"
    except httpx.HTTPError as exc:
        # The connection failed or broke (a SIGKILLed gateway): the client saw it.
        result.outcome = "failed" if result.request_id else "refused"
        result.detail = repr(exc)
    result.latency_s = time.monotonic() - began
    return result


def _plain(resp: httpx.Response, result: Result) -> None:
    if resp.status_code == 200:
        obj = resp.json()
        result.request_id, result.text, result.outcome = obj["id"], text_of_response(obj), "completed"
        return
    result.detail = f"{resp.status_code} {resp.text[:200]}"
    result.outcome = "server_error" if resp.status_code == 500 else "failed"


def _stream(http: httpx.Client, spec: Spec, result: Result) -> None:
    parts: list[str] = []
    with http.stream("POST", "/v1/completions", json={**spec.body, "stream": True}) as resp:
        if resp.status_code != 200:
            resp.read()
            result.outcome, result.detail = "failed", f"{resp.status_code} {resp.text[:200]}"
            return
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                result.outcome, result.text = "completed", "".join(parts)
                return
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.outcome, result.detail = "failed", str(event["error"])[:200]
                return
            result.request_id = event["id"]
            parts.extend(c.get("text") or "" for c in event["choices"])
    result.outcome, result.detail = "failed", "the stream ended without [DONE] or an error event"
    result.extra["silent_end"] = True


def _job(http: httpx.Client, spec: Spec, result: Result, deadline_s: float, gateways: list[str]) -> None:
    resp = http.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": spec.body})
    if resp.status_code != 202:
        result.outcome, result.detail = "failed", f"{resp.status_code} {resp.text[:200]}"
        return
    job_id = result.request_id = resp.json()["id"]
    if spec.kind == "cancel":
        time.sleep(random.Random(spec.index).uniform(0.05, 0.5))
        for url in gateways:  # the first gateway that answers takes the cancel
            try:
                httpx.delete(f"{url}/v1/jobs/{job_id}", timeout=5)
                break
            except httpx.HTTPError:
                continue
    end = time.monotonic() + deadline_s
    turn = 0
    while time.monotonic() < end:
        turn += 1
        try:  # a job outlives its gateway: poll whichever answers, as a client with two addresses would
            got = httpx.get(f"{gateways[turn % len(gateways)]}/v1/jobs/{job_id}", timeout=5)
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        if got.status_code == 404:
            result.outcome, result.detail = "failed", "the job's record is gone (404)"
            return
        if got.status_code != 200:  # 503 while Redis restarts: a client polls again
            time.sleep(0.2)
            continue
        view = got.json()
        if view["status"] in ("completed", "failed", "cancelled"):
            result.outcome = view["status"]
            if view["status"] == "completed":
                result.text = view["result"]["choices"][0]["text"]
            else:
                result.detail = str(view.get("error"))[:200]
            return
        time.sleep(0.2)
    result.outcome, result.detail = "lost", "the job never finished"
