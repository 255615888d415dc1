"""A request's data and its place in the state machine.

    WAITING ──admit──> RUNNING ──> FINISHED_{STOPPED, LENGTH, ABORTED, ERROR}
       ^                  │
       └──── PREEMPTED <──┘        (blocks dropped; recomputed when re-admitted)

Progress is a single counter, ``num_computed_tokens``: the tokens (prompt, then outputs) whose K/V
sit in the cache. Prefill, chunked prefill, prefix-cache hits and decode are all just this counter
catching up with ``num_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.prompt_logprobs import PromptLogprobs
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    # Ordered so that "finished" is one comparison: status > PREEMPTED.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestTimeline:
    """Wall-clock instants (time.monotonic) of a request's life; None until reached."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or self.last_token is None or num_output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (num_output_tokens - 1)


class Request:
    """One sequence in the engine. A request with n > 1 becomes n sibling Requests (see LLMEngine)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        parent_id: str | None = None,
        index: int = 0,
        resumed_output_token_ids: list[int] | None = None,
        seed: int = 0,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id  # the id the caller knows (n > 1 shares it)
        self.index = index  # which of the parent's n completions this is
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        # Deadlines the slo policy schedules by (seconds; None = none): first token within slo_ttft_s
        # of arrival, then on average one token every slo_tpot_s.
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        # Always set (drawn by the engine when the caller gave none): sampling draws depend only on
        # (seed, output index), which keeps a request reproducible whatever shares its batch.
        self.seed = seed
        self.status = RequestStatus.WAITING
        self.timeline = RequestTimeline()
        if arrival_time is not None:
            self.timeline.arrival = arrival_time
        # Tokens produced before this engine saw the request (a resumed stream): they count as output
        # for max_tokens, penalties and seeded sampling, and are prefilled again like the prompt.
        self.output_token_ids: list[int] = list(resumed_output_token_ids or [])
        self.num_resumed_tokens = len(self.output_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        # Async scheduling only: tokens a step in flight will sample for this request, not known yet.
        # The scheduler plans the next step as if they were there (num_computed_tokens counts the
        # step's work when it is scheduled); each drops to a real token when its step reports.
        self.num_output_placeholders = 0
        # Prompt tokens whose K/V came from the prefix cache at the last admission.
        self.num_cached_tokens = 0
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        self.logprobs: list[dict[int, float]] = []
        # Prompt logprobs gathered chunk by chunk (requests that ask); sent once, with the first token.
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # the request field an input error blames (a bad grammar)
        # Structured outputs: its grammar still compiles on the engine's helper thread
        # (engine/structured/background.py); the scheduler leaves it waiting until then.
        self.waiting_for_grammar = False
        # The seed's per-request timeline, in order: (event, time.monotonic(), attributes).
        # queued, admitted, prefill_chunk, first_token, preempted, resumed, finished. Bounded: one
        # entry per prefill chunk or preemption, never one per decode step.
        self.events: list[tuple[str, float, dict[str, int | str]]] = []

    def record(self, event: str, now: float, **attrs: int | str) -> None:
        self.events.append((event, now, attrs))

    # ---- counts --------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_new_output_tokens(self) -> int:
        """Output tokens generated by this engine (excludes a resumed stream's earlier tokens)."""
        return len(self.output_token_ids) - self.num_resumed_tokens

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}"
            f"/{self.num_tokens}, out={self.num_output_tokens})"
        )
