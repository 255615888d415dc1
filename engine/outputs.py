"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


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
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    queue_time: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
