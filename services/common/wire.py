"""Versioned wire messages: the Kafka request, the token events, the cancel notice.

Every message is a JSON object with ``"v"`` (the schema version) and ``"type"``. A reader rejects a
version it does not know with ``WireError`` instead of guessing: a mixed-version deployment then fails
loudly at the first message, not subtly in the middle of a stream.

Token events carry ``seq``, numbered 1, 2, 3... per request across workers (a resumed request continues
the numbering), so a reader detects a gap (seq jumps) or a duplicate (seq already seen).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from engine.outputs import PromptLogprobList
from services.common.wire_sampling import SamplingWireError, WireSampling

WIRE_VERSION = 1

# Request (job) statuses, as the record and the jobs API show them.
QUEUED = "queued"
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})

Kind = Literal["completion", "chat"]


# Every token event is encoded once by a worker and decoded once by a gateway: msgspec is several times
# faster than json at both.
_fast_loads = msgspec.json.Decoder().decode
_fast_dumps = msgspec.json.Encoder().encode


class WireError(ValueError):
    """A message that this build cannot read: unknown version or type, or a malformed field."""


def _load(raw: bytes | str, expected_type: tuple[str, ...]) -> dict[str, Any]:
    try:
        obj = _fast_loads(raw)
    except msgspec.DecodeError:
        # msgspec reads strict JSON; Python's json also reads NaN and Infinity (a logprob may be -inf).
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WireError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError("a wire message must be a JSON object")
    version = obj.get("v")
    if version != WIRE_VERSION:
        raise WireError(f"unsupported wire version {version!r}: this build reads version {WIRE_VERSION} only")
    if obj.get("type") not in expected_type:
        raise WireError(f"unexpected message type {obj.get('type')!r}; expected one of {expected_type}")
    return obj


def _require(obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"field {name!r} missing or of the wrong type: {value!r}")
    return value


def _int_list(obj: dict[str, Any], name: str) -> list[int]:
    value = _require(obj, name, list)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise WireError(f"field {name!r} must be a list of integers")
    return value


@dataclass(frozen=True)
class RequestMessage:
    """What the gateway produces to Kafka: a tokenised, validated request."""

    id: str
    kind: Kind
    model: str
    prompt_token_ids: list[int]
    params: WireSampling  # typed and versioned on its own (wire_sampling.py), validated by the gateway
    created: float  # unix seconds at admission
    priority: int = 0
    job: bool = False
    # A gateway without the model's tokenizer sends text instead of token ids (prompt_token_ids
    # empty): the completion prompt, or the chat messages to render with the model's template.
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # For ``messages``: whether the template appends the assistant turn's opening.
    add_generation_prompt: bool = True
    # Deadlines for the engine's slo policy, milliseconds; None: the engine's defaults. Optional in
    # both directions within version 1: omitted when None, so an older worker reads the message as
    # before, and a message without them decodes as None.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Whether a client reads the tokens as they come (SSE). False (a whole response, a job): the worker
    # may hold token events back a little and send them in fewer round trips. Absent: True.
    stream: bool = True
    # Unix seconds (wall clock, so gateway and worker hosts need synchronised clocks) by which an engine
    # must start this request: past it a worker fails it with code "timeout" instead of prefilling it
    # (its client has given up). None: no deadline. Optional like the slo fields: omitted when None.
    deadline: float | None = None

    def encode(self) -> bytes:
        fields = {k: v for k, v in vars(self).items() if not (k in _OMIT_NONE and v is None)}
        body = {"v": WIRE_VERSION, "type": "request", **fields, "params": self.params.to_json()}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> RequestMessage:
        obj = _load(raw, ("request",))
        kind = _require(obj, "kind", str)
        if kind not in ("completion", "chat"):
            raise WireError(f"unknown request kind {kind!r}")
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if not isinstance(prompt, str | None) or not isinstance(messages, list | None):
            raise WireError("prompt must be a string and messages a list")
        try:
            params = WireSampling.from_json(obj.get("params"))
        except SamplingWireError as exc:
            raise WireError(str(exc)) from None
        return cls(
            id=_require(obj, "id", str),
            kind=kind,
            model=_require(obj, "model", str),
            prompt_token_ids=_int_list(obj, "prompt_token_ids"),
            params=params,
            created=float(_require(obj, "created", (int, float))),
            priority=int(obj.get("priority", 0)),
            job=bool(obj.get("job", False)),
            prompt=prompt,
            messages=messages,
            add_generation_prompt=bool(obj.get("add_generation_prompt", True)),
            slo_ttft_ms=_optional_ms(obj, "slo_ttft_ms"),
            slo_tpot_ms=_optional_ms(obj, "slo_tpot_ms"),
            stream=bool(obj.get("stream", True)),
            deadline=_optional_deadline(obj),
        )


_OMIT_NONE = frozenset({"slo_ttft_ms", "slo_tpot_ms", "deadline"})


def _optional_deadline(obj: dict[str, Any]) -> float | None:
    value = obj.get("deadline")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise WireError(f"deadline must be unix seconds (a positive number), got {value!r}")
    return float(value)


def _optional_ms(obj: dict[str, Any], name: str) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise WireError(f"{name} must be a positive number of milliseconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DeltaEvent:
    """New tokens of completion ``index``; the last one of an index carries its finish_reason."""

    id: str
    seq: int
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # Per token: [[token id, logprob], ...] top candidates, the sampled token included.
    logprobs: list[list[list[float]]] | None = None
    worker: str = ""  # which worker generated it (crash tests check that a resume really happened)

    type: Literal["delta"] = field(default="delta", init=False)


@dataclass(frozen=True)
class DoneEvent:
    """The request is terminal. Always the last event of a request."""

    id: str
    seq: int
    status: str  # COMPLETED | FAILED | CANCELLED
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    code: str | None = None  # machine-readable error kind, e.g. "engine_error", "lost_by_broker"
    worker: str = ""
    param: str | None = None  # the request field an invalid_request error blames (OpenAI's "param")
    # Prompt tokens whose K/V came from the engine's prefix cache (OpenAI's usage.prompt_tokens_details).
    cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt of the request (several for a batched completions
    # prompt), vLLM's list for it: None for the first token, then {token id: {"logprob", "rank",
    # "decoded_token"}} per token.
    prompt_logprobs: list[list[dict[str, dict[str, Any]] | None]] | None = None

    type: Literal["done"] = field(default="done", init=False)


Event = DeltaEvent | DoneEvent


def prompt_logprobs_json(entries: PromptLogprobList) -> list[dict[str, dict[str, Any]] | None]:
    """The engine's prompt logprobs in vLLM's response shape (token ids as strings: JSON's keys)."""
    return [
        None
        if e is None
        else {
            str(tok): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tok, lp in e.items()
        }
        for e in entries
    ]


def encode_event(event: Event) -> str:
    # vars(), not asdict(): one per token on the hot path, and asdict deep-copies every list.
    body = {"v": WIRE_VERSION, "type": event.type, **vars(event)}
    if isinstance(event, DoneEvent) or event.logprobs is None:
        # No floats, so msgspec writes the same JSON (non-ASCII as UTF-8, not \u escapes) several times
        # faster; with logprobs json's encoder keeps -Infinity, which msgspec would write as null.
        try:
            return _fast_dumps(body).decode()
        except UnicodeEncodeError:
            pass  # a lone surrogate in the text: json escapes it
    return json.dumps(body, separators=(",", ":"))


def decode_event(raw: bytes | str) -> Event:
    obj = _load(raw, ("delta", "done"))
    request_id, seq = _require(obj, "id", str), _require(obj, "seq", int)
    if obj["type"] == "delta":
        return DeltaEvent(
            id=request_id,
            seq=seq,
            index=_require(obj, "index", int),
            token_ids=_int_list(obj, "token_ids"),
            text=_require(obj, "text", str),
            finish_reason=obj.get("finish_reason"),
            stop_reason=obj.get("stop_reason"),
            logprobs=obj.get("logprobs"),
            worker=str(obj.get("worker", "")),
        )
    status = _require(obj, "status", str)
    if status not in TERMINAL:
        raise WireError(f"done event with non-terminal status {status!r}")
    return DoneEvent(
        id=request_id,
        seq=seq,
        status=status,
        prompt_tokens=int(obj.get("prompt_tokens", 0)),
        completion_tokens=int(obj.get("completion_tokens", 0)),
        error=obj.get("error"),
        code=obj.get("code"),
        worker=str(obj.get("worker", "")),
        param=obj.get("param") if isinstance(obj.get("param"), str) else None,
        cached_tokens=int(obj.get("cached_tokens", 0)),
        prompt_logprobs=obj.get("prompt_logprobs") if isinstance(obj.get("prompt_logprobs"), list) else None,
    )


@dataclass(frozen=True)
class CancelMessage:
    """Published on the cancel channel: every worker hears it, the one running ``id`` aborts it."""

    id: str

    def encode(self) -> str:
        return json.dumps({"v": WIRE_VERSION, "type": "cancel", "id": self.id})

    @classmethod
    def decode(cls, raw: bytes | str) -> CancelMessage:
        return cls(id=_require(_load(raw, ("cancel",)), "id", str))
