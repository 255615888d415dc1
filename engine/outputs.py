"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from engine.metrics import RequestRecord

L = TypeVar("L")  # one token's logprobs: a dict in the engine, [token id, logprob] pairs on the wire


@dataclass
class CompletionOutput:
    """One of a request's n completions.

    In the offline API (``LLM.generate``) ``token_ids`` and ``text`` are cumulative. In the streaming
    API (``AsyncLLMEngine.generate``) they are the delta since the previous output of this index.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # One dict per token in token_ids: token id -> logprob, the sampled token included.
    logprobs: list[dict[int, float]] | None = None
    num_output_tokens: int = 0  # cumulative count, also in delta mode

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Logprob:
    """One token's entry in a prompt's logprobs (vLLM's ``Logprob``)."""

    logprob: float
    rank: int  # 1: the most likely token at its position
    decoded_token: str | None = None


# One per prompt token: None for the first (nothing scores it), else token id -> its Logprob, holding
# the prompt token itself and the top-k.
PromptLogprobList = list[dict[int, Logprob] | None]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # The finished request's timings and counts: the same record the engine's exporters get.
    metrics: RequestRecord | None = None
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
    # With ``error``: the request field it blames, when the input was at fault (a grammar that did not
    # compile); the worker answers such a failure as a 400 naming it.
    error_param: str | None = None
    # SamplingParams.prompt_logprobs: the prompt's logprobs, in the first output that has them (in
    # ``LLM.generate``'s final output too); None when not asked for.
    prompt_logprobs: PromptLogprobList | None = None


@dataclass
class Choice(Generic[L]):
    """One completion index, whole: what the deltas of that index add up to."""

    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)  # joined on read: appends stay O(1)
    logprobs: list[L] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class ChoiceAccumulator(Generic[L]):
    """Folds a request's per-index deltas into whole choices.

    The one accumulator of a response: the offline API (``LLM.generate``), the worker's final record and
    the gateway's non-streaming response all fold their deltas here.
    """

    def __init__(self, n: int = 0) -> None:
        self.choices: dict[int, Choice[L]] = {i: Choice() for i in range(n)}

    def add(
        self,
        index: int,
        token_ids: list[int],
        text: str,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        logprobs: list[L] | None = None,
    ) -> None:
        choice = self.choice(index)
        choice.token_ids.extend(token_ids)
        choice.text_parts.append(text)
        if logprobs:
            choice.logprobs.extend(logprobs)
        if finish_reason is not None:
            choice.finish_reason, choice.stop_reason = finish_reason, stop_reason

    def choice(self, index: int) -> Choice[L]:
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = Choice()
        return choice

    def finished(self, index: int) -> bool:
        choice = self.choices.get(index)
        return choice is not None and choice.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())
