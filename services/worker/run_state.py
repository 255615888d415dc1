"""One request as a worker sees it: what it has emitted, and how it must end.

A ``Run`` holds the request's identity and its status (``RunState``, whose changes live in lifecycle.py
alone); what it has produced so far lives in ``Output`` (the one accumulator the final record is built
from), what still has to reach Redis in ``Outbox`` (the publisher's state), and its tracing state in
``RunTrace``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from enum import StrEnum
from typing import Any

from aiokafka.structs import TopicPartition
from opentelemetry import trace
from opentelemetry.context import Context

from engine.outputs import ChoiceAccumulator
from services.common.wire import DeltaEvent, DoneEvent, RequestMessage, encode_event
from services.worker.lifecycle import RunState, RunStatus


class Outcome(StrEnum):
    """How the worker let go of a request (the ``outcome`` label of ``inflight:worker_outcomes_total``)."""

    DONE = "done"  # finished here: its terminal event and record are in Redis
    SKIPPED = "skipped"  # found terminal in Redis (a redelivery, cancelled while in Kafka, a retry's)
    HANDED_BACK = "handed_back"  # drain: stopped unfinished; another worker resumes it from the log
    FENCED = "fenced"  # another worker owns it now (it lost the lease or its writes were refused)
    ERROR = "error"  # the worker itself failed running it, and its record may not be terminal
    REJECTED = "rejected"  # the Kafka message could not be read

    @property
    def releases_offset(self) -> bool:
        """Whether the request's offsets may be committed: only once its record is terminal or another
        worker holds it. Not a handed-back request (another worker must still read it from the log),
        nor one that ended in error: its record may still say "queued", and committing past it would
        lose the request."""
        return self not in (Outcome.HANDED_BACK, Outcome.ERROR)


@dataclass
class PendingDelta:
    """A delta not yet numbered: the publisher assigns seq when it sends, after merging neighbours."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[list[list[float]]] | None = None

    def approx_bytes(self) -> int:
        """About what this delta adds to the log once encoded (an id, a logprob pair: ~28 bytes each),
        known before it is numbered, so the log bound is checked on every step, not every publish."""
        pairs = sum(len(candidates) for candidates in self.logprobs or ())
        return len(self.text.encode()) + 8 * len(self.token_ids) + 28 * pairs


@dataclass
class Final:
    status: str
    error: str | None = None
    code: str | None = None
    fields: dict[str, str | int | float] = field(default_factory=dict)
    param: str | None = None  # the request field an invalid_request error blames


# Everything the request has emitted, per completion index (resumed tokens included): the one
# accumulator the final record is built from. Logprobs are not kept: the record has none.
Output = ChoiceAccumulator[list[list[float]]]


def record(output: Output, delta: PendingDelta) -> None:
    output.add(delta.index, delta.token_ids, delta.text, delta.finish_reason, delta.stop_reason)


@dataclass
class Outbox:
    """The publisher's state for one request: deltas waiting to be numbered, numbered events waiting
    for Redis, and the end (its terminal event is numbered once, after every delta)."""

    seq: int = 0  # last sequence number used
    pending: list[PendingDelta] = field(default_factory=list)
    unsent: list[str] = field(default_factory=list)
    final: Final | None = None
    done_numbered: bool = False
    final_sent: asyncio.Future[None] | None = None
    # Bytes of the delta events numbered for the log so far, by every worker that ran it (a resume counts
    # the log it found): the request's share of Redis, bounded by INFLIGHT_MAX_LOG_BYTES.
    logged_bytes: int = 0
    pending_bytes: int = 0  # the deltas in ``pending``, estimated (PendingDelta.approx_bytes)


@dataclass
class RunTrace:
    """The consume span (the request's life in this worker) and the context publish spans go under while
    the engine runs it (its engine span). INVALID_SPAN (a no-op) until consumed."""

    span: trace.Span = field(default=trace.INVALID_SPAN, repr=False)
    publish_parent: Context | None = field(default=None, repr=False)
    first_publish_traced: bool = False


@dataclass(eq=False)
class Run:
    msg: RequestMessage
    # Every delivery of this request to this worker (a redelivery attaches here): (partition, offset,
    # tracker generation). All are marked done when the request is terminal.
    deliveries: list[tuple[TopicPartition, int, int]] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)  # the message's, or tokenized here
    key: bytes | None = None  # its Kafka message's key (to find the message again, or produce it again)
    output: Output = field(default_factory=Output)
    outbox: Outbox = field(default_factory=Outbox)
    tracing: RunTrace = field(default_factory=RunTrace)
    # Its status and errors: changed by events only (lifecycle.py). A retry (worker.py) passes the
    # failed attempt's as ``retry_of``: the new attempt starts FETCHED with its errors.
    state: RunState = field(init=False)
    retry_of: InitVar[RunState | None] = None
    resumed_from: int = 0  # output tokens that came from the log (a crash resume)
    holds_lease: bool = False
    epoch: int = 0  # the claim's fencing token (Store.start): every write to Redis carries it
    engine_ids: set[str] = field(default_factory=set)  # ids live in the engine now
    # An engine died under an earlier claim of it (its record counts engine failures): it runs alone on
    # its engine (quarantine.py), so if it kills this one too, no neighbour is blamed with it.
    suspect: bool = False
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (usage)
    # When the engine core took it and sampled its first token (time.monotonic, one clock for every
    # process of the host): the record's split of the worker's time to a first token.
    engine_arrival: float | None = None
    engine_first_token: float | None = None
    # SamplingParams.prompt_logprobs: the prompt's, in vLLM's response shape (wire.prompt_logprobs_json).
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    log_full: bool = False  # its log reached INFLIGHT_MAX_LOG_BYTES: failed, its engine request aborted
    task: asyncio.Task[Outcome] | None = None

    def __post_init__(self, retry_of: RunState | None) -> None:
        self.state = RunState(self.msg.id) if retry_of is None else retry_of.next_attempt()

    @property
    def id(self) -> str:
        return self.msg.id

    @property
    def span(self) -> trace.Span:
        return self.tracing.span

    # ---- its status, read-only (lifecycle.py changes it) ---------------------------------------
    @property
    def status(self) -> RunStatus:
        return self.state.status

    @property
    def cancelled(self) -> bool:
        """The client asked: it finishes as cancelled."""
        return self.state.status is RunStatus.CANCELLED

    @property
    def handed_back(self) -> bool:
        """It stops without finishing; another worker resumes it."""
        return self.state.status is RunStatus.HANDED_BACK

    @property
    def fenced(self) -> bool:
        """Another worker owns it now: it stops silently."""
        return self.state.status is RunStatus.FENCED

    @property
    def stopping(self) -> bool:
        return self.state.stopping

    @property
    def errors(self) -> Mapping[int, str]:
        """Completion index -> why it failed."""
        return self.state.errors

    def number_outbox(self, worker: str) -> None:
        """Merge adjacent pending deltas of one index and number them into ``outbox.unsent``.

        Merging keeps Redis and the client's SSE from paying per token when the publisher is behind
        (a batch of steps arrives at once); it never crosses an index or a finish.
        """
        box = self.outbox
        merged: list[PendingDelta] = []
        for d in box.pending:
            last = merged[-1] if merged else None
            if last is not None and last.index == d.index and last.finish_reason is None:
                last.token_ids = last.token_ids + d.token_ids
                last.text += d.text
                last.finish_reason, last.stop_reason = d.finish_reason, d.stop_reason
                if d.logprobs is not None:
                    last.logprobs = (last.logprobs or []) + d.logprobs
            else:
                merged.append(PendingDelta(**vars(d)))
        box.pending = []
        box.pending_bytes = 0
        for d in merged:
            box.seq += 1
            event = DeltaEvent(
                id=self.id,
                seq=box.seq,
                index=d.index,
                token_ids=d.token_ids,
                text=d.text,
                finish_reason=d.finish_reason,
                stop_reason=d.stop_reason,
                logprobs=d.logprobs,
                worker=worker,
            )
            encoded = encode_event(event)
            box.logged_bytes += len(encoded)
            box.unsent.append(encoded)

    def done_event(self, worker: str) -> str:
        box = self.outbox
        assert box.final is not None
        box.done_numbered = True
        box.seq += 1
        done = DoneEvent(
            id=self.id,
            seq=box.seq,
            status=box.final.status,
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=self.output.num_tokens,
            error=box.final.error,
            code=box.final.code,
            worker=worker,
            param=box.final.param,
            cached_tokens=self.cached_tokens,
            prompt_logprobs=None if self.prompt_logprobs is None else [self.prompt_logprobs],
        )
        return encode_event(done)
