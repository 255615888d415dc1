"""Request bodies of the OpenAI-compatible API, with the engine's extra sampling fields as vLLM has them.

No field is dropped silently: a body's fields are each applied, declared as changing nothing (OpenAI's
``store``, ``metadata``...), or refused with a 400 naming them (``fields.py`` holds the lists and the
check; an unknown field lands in ``model_extra`` and is refused there, not by pydantic, so the answer
is OpenAI's 400 with ``param`` set). Bounds here are the structural ones; limits that depend on the
model (context length, vocabulary) are checked in ``prompts.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_MAX_SEED = 2**62  # the engine derives seed + i for n completions; keep that inside 63 bits
_MAX_INT = 2**31 - 1
# OpenAI's bound on logit_bias entries; values are clamped to [-100, 100] as OpenAI documents.
MAX_LOGIT_BIAS = 300

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=_MAX_INT)]
# Bounded: the detokenizer checks every step whether the output's tail could begin a stop string, a
# scan that grows with the square of a stop string's length.
StopStr = Annotated[str, Field(min_length=1, max_length=1024)]
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


def reject_unencodable(data: Any) -> Any:
    """Refuse any string (key or value, at any depth) that is not valid Unicode text.

    JSON may spell a lone UTF-16 surrogate (``"\\ud800"``); Python decodes it into a str that no
    UTF-8 encoder accepts, so it would fail later, deep in tokenizing, hashing or producing, as a 500.
    Iterative, so a deeply nested body cannot exhaust the stack; ``str.encode`` runs in C.
    """
    todo = [data]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate (not valid Unicode text)") from None
        elif isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return data


class _Checked(BaseModel):
    """A request body: every string in it must be encodable text (checked before field validation)."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return reject_unencodable(data)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(_Checked):
    # "allow": unknown fields are kept in model_extra for fields.check_fields to refuse by name.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStr | list[StopStr] | None = Field(None, max_length=16)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    user: str | None = None
    # Token id (as a string, JSON's only key type) -> bias added to its logit; checked in prompts.py.
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: the top-k logprobs of every prompt token (and the token itself), in each choice.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, le=_MAX_INT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0, le=_MAX_INT)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_MAX_INT)]] | None = Field(None, max_length=64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(2**31), le=_MAX_INT)
    # Deadlines for the engine's slo policy (milliseconds; none: the engine's defaults).
    slo_ttft_ms: float | None = Field(None, gt=0.0, le=1e9)
    slo_tpot_ms: float | None = Field(None, gt=0.0, le=1e9)
    # Prefix affinity: requests of one session go to one engine (its prefix cache). Falls back to user.
    session_id: str | None = Field(None, max_length=256)
    # Structured outputs (services/gateway/tools.py): OpenAI's response_format, or one of vLLM's guided_*.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=65536)
    guided_choice: list[NonEmptyStr] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, min_length=1, max_length=65536)
    # vLLM's one object for all of them ({"json": ...}, {"regex": ...}, {"choice": [...]}, ...): tools.py.
    structured_outputs: dict[str, Any] | None = None
    # Accepted and changing nothing in the output (fields.IGNORED): OpenAI's bookkeeping fields.
    store: bool | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    service_tier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(None, max_length=256)  # a session key, like session_id
    safety_identifier: str | None = Field(None, max_length=256)


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=_MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=16)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=128)  # an assistant's earlier calls


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=_MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=_MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    parallel_tool_calls: bool | None = None
    # Variables for the chat template (e.g. {"enable_thinking": false}); services/gateway/chat_template.py.
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)


class JobRequest(_Checked):
    """An asynchronous job: the body of a completions or chat request, run without holding a connection."""

    model_config = ConfigDict(extra="ignore")
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict[str, Any]
    # OpenAI's limits for metadata: 16 pairs, keys up to 64 characters, values up to 512. Stored in the
    # job's record and returned by every GET, so unbounded values would grow both.
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
