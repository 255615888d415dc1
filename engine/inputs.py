"""What enters the engine: the prompt, prepared once, and the one request type that carries it.

Torch-free, so the gateway imports it. Every edge that holds the tokenizer prepares a prompt with
``prepare_prompt``: the gateway when it has the checkpoint, the worker when the gateway sent text, and
the engine's own API (``LLMEngine.add_request``) for callers that bypass both. The rules (empty, longer
than the context, token ids outside the vocabulary) and their errors therefore cannot drift apart, and
every edge reads the context length from the one rule the engine's config uses (``ModelContext``).

``EngineRequest`` is what a caller hands the engine, in process (``LLMEngine.add_request``,
``AsyncLLMEngine.generate``) or across the core's pipe (``EngineCoreClient.generate``): adding a field
is one edit here, and the core's pipe carries it as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


# ---- the errors: the input's fault, naming the field to blame ----------------------------------
class PromptError(ValueError):
    """The prompt is refused as the input's fault. ``param`` names the request field to blame; the HTTP
    edge answers it as OpenAI's 400, the core's pipe carries it as a ``Failure``."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[PromptError], tuple[str, str]]:
        # An exception unpickles as cls(*self.args), and args holds the message only: rebuild from both.
        return type(self), (str(self), self.param)


class ContextLengthError(PromptError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


EMPTY_PROMPT = "the prompt is empty"
NO_TOKENIZER = "this model has no tokenizer: send the prompt as token ids"


# ---- the context length: one rule for the engine's config and the gateway ----------------------
@dataclass(frozen=True)
class ModelContext:
    """The facts of a checkpoint's ``config.json`` that bound its context."""

    max_position_embeddings: int
    sliding_window: int | None
    rope_scaling: dict[str, Any] | None  # None: plain RoPE, no extension past max_position_embeddings

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ModelContext:
        rope_scaling = raw.get("rope_scaling")
        # transformers >= 5 folds the scaling into rope_parameters.
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict) and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        # Mistral always applies its window when one is set; Qwen2 only with use_sliding_window.
        mistral = "MistralForCausalLM" in (raw.get("architectures") or [])
        window = raw.get("sliding_window") if mistral or raw.get("use_sliding_window") else None
        return cls(int(raw.get("max_position_embeddings", 2048)), window, rope_scaling)

    def max_model_len(self, requested: int | None = None) -> int:
        """The context this engine serves: ``requested`` (None: the model's own), checked.

        A sliding window bounds what each position attends, not the context: a Mistral checkpoint with
        32768 positions and a 4096 window serves 32768 when nothing is asked for (each token attends
        its last 4096 positions, as HF does); a Llama with 2048 positions and no rope scaling refuses
        4096.
        """
        max_len = requested or self.max_position_embeddings
        if max_len > self.max_position_embeddings and self.rope_scaling is None:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"{self.max_position_embeddings}"
            )
        return max_len


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt is checked against. None: unknown at this edge (a gateway without the checkpoint),
    so that check is left to the edge that knows."""

    max_model_len: int | None
    vocab_size: int | None
    # Chat messages one prompt may have (None: no bound). Each message costs the template's render and
    # the tokenizer work however short it is: a bound on their contents alone lets 100,000 empty
    # messages through.
    max_messages: int | None = None


def check_context_length(num_prompt_tokens: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """Raise ``ContextLengthError`` unless the prompt leaves room for ``max_tokens`` (None: for one token).

    Example, max_model_len 8: a prompt of 7 fits with max_tokens None or 1; with max_tokens 2 it does not
    (blame max_tokens); a prompt of 8 never fits (blame the prompt).
    """
    wanted = num_prompt_tokens + (max_tokens or 1)
    if wanted <= max_model_len:
        return
    asked = f"{num_prompt_tokens} in the prompt" + (f" + {max_tokens} to generate" if max_tokens else "")
    raise ContextLengthError(
        f"This model's maximum context length (max_model_len) is {max_model_len} tokens; this request asks "
        f"for {asked}. Shorten the prompt or lower max_tokens.",
        "prompt" if num_prompt_tokens >= max_model_len else "max_tokens",
    )


# ---- preparation --------------------------------------------------------------------------------
def check_prompt_text(text: str) -> None:
    """What an edge without the tokenizer can check of a text prompt; the edge with it checks the rest."""
    if not text:
        # Refused before tokenizing, even where the tokenizer would add bos: an edge without the
        # tokenizer cannot know that, and every edge must answer the same.
        raise PromptError(EMPTY_PROMPT)


def prepare_prompt(
    prompt: str | Sequence[int] | None,
    limits: PromptLimits,
    tokenizer: Tokenizer | None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
) -> list[int]:
    """The prompt's token ids, checked: text is encoded (with the tokenizer's special tokens), chat
    ``messages`` (given instead of ``prompt``) rendered with the model's template, token ids taken as
    they are. Raises ``PromptError`` (``ContextLengthError`` for length) naming the field to blame.

    ``max_tokens``: the tokens the request asks for, checked against the context with the prompt (the
    OpenAI edges); None checks that the prompt leaves room for one (the engine's own API, which stops a
    longer request at the context instead).
    """
    if messages is not None:
        if tokenizer is None:
            raise PromptError(NO_TOKENIZER, "messages")
        check_message_count(len(messages), limits)
        _refuse_clearly_too_long(sum(len(str(m.get("content") or "")) for m in messages), limits, tokenizer)
        try:
            text = tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # template code is the checkpoint's: any failure is the input's fault
            raise PromptError(f"the chat template rejected these messages: {exc}", "messages") from None
        # The rendered text holds the template's own text around every message too: bounded the same
        # way before it is tokenized.
        _refuse_clearly_too_long(len(text), limits, tokenizer, "messages")
        # The rendered template already holds bos and the other special tokens.
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, str):
        check_prompt_text(prompt)
        if tokenizer is None:
            raise PromptError(NO_TOKENIZER)
        _refuse_clearly_too_long(len(prompt), limits, tokenizer)
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = [int(t) for t in prompt or ()]
    check_prompt_ids(ids, limits, max_tokens)
    return ids


def check_message_count(num_messages: int, limits: PromptLimits) -> None:
    """Refuse more chat messages than the edge allows, before anything renders them."""
    if limits.max_messages is not None and num_messages > limits.max_messages:
        raise PromptError(
            f"this request has {num_messages} messages, more than the {limits.max_messages} a prompt may "
            "have",
            "messages",
        )


def check_prompt_ids(ids: Sequence[int], limits: PromptLimits, max_tokens: int | None = None) -> None:
    """The checks on token ids, wherever they came from (see ``prepare_prompt``)."""
    if not ids:
        raise PromptError(EMPTY_PROMPT)
    vocab = limits.vocab_size
    if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
        raise PromptError(f"prompt token ids must be in [0, {vocab}) (the vocabulary)")
    if limits.max_model_len is not None:
        check_context_length(len(ids), limits.max_model_len, max_tokens)


def _refuse_clearly_too_long(
    num_chars: int, limits: PromptLimits, tokenizer: Tokenizer, param: str = "prompt"
) -> None:
    """Refuse text that cannot fit the context before paying to tokenize it (megabytes take seconds).

    No token is longer than the vocabulary's longest token string, so the text has at least
    num_chars / that many tokens; when even that exceeds the context, the answer is known already.
    """
    if limits.max_model_len is None:
        return
    per_token = _max_token_chars(tokenizer)
    if num_chars > limits.max_model_len * per_token:
        raise ContextLengthError(
            f"This model's maximum context length (max_model_len) is {limits.max_model_len} tokens; this "
            f"prompt's {num_chars} characters are at least {num_chars // per_token} tokens. Shorten the "
            "prompt.",
            param,
        )


@functools.cache
def _max_token_chars(tokenizer: Tokenizer) -> int:
    # Byte-level token strings spell each byte as one character: an over-estimate, which is safe here.
    tokens = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
    return max(1, max((len(t) for t in tokens if t), default=1))


# ---- the request --------------------------------------------------------------------------------
class EngineRequest(msgspec.Struct, frozen=True, array_like=True):
    """One request for the engine: what every entry point takes and the core's pipe carries.

    With ``params.n`` > 1 the engine fans it out into n sequences seeded seed + i. ``resume_token_ids``:
    tokens already streamed (every index); ``resume_by_index``: per index, for a stream whose completions
    stopped at different points; ``indexes``: run only these completions (the others finished before a
    resume). ``slo_ttft_s`` / ``slo_tpot_s`` override the engine's default deadlines (slo policy).
    """

    request_id: str
    prompt: list[int] | str  # token ids, or text for the front end's tokenizer (the core takes ids)
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first (priority policy)
    arrival_time: float | None = None  # time.monotonic() when it arrived; None: when the engine takes it
    resume_token_ids: list[int] | None = None
    resume_by_index: dict[int, list[int]] | None = None
    indexes: list[int] | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # Set by the front end that tokenized the prompt: its tokenizer's eos ids, the primary first. The
    # core itself holds no tokenizer; without these it stops at the model config's eos ids only.
    eos_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name, value in (("slo_ttft_s", self.slo_ttft_s), ("slo_tpot_s", self.slo_tpot_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.resume_token_ids is not None and self.resume_by_index is not None:
            raise ValueError("give resume_token_ids (every index) or resume_by_index, not both")
