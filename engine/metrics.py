"""Engine statistics: one record per step, one per finished request, for exporters to consume."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch-free at run time: the gateway's span and metric code imports this module,
    # and the worker's side of an engine core in another process unpickles these records
    from engine.request import Request


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linearly interpolated between closest ranks (numpy's default); NaN for no
    values. The one percentile of the project: the stall watchdog, the planner and the benchmarks.

    Example: [1, 2, 3, 4], q=50 -> rank 1.5 -> 2.5; q=99 -> rank 2.97 -> 3.97.
    """
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass
class SchedulerStats:
    """The scheduler's counts after a step (or an arrival / abort): the engine's load, as exported."""

    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_scheduled_seqs: int
    kv_usage: float
    num_free_blocks: int
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    num_preemptions: int  # cumulative
    step_preemptions: int
    num_allocation_failures: int = 0  # cumulative: times the pool said "no room"
    num_total_blocks: int = 0

    def kv_stats(self) -> dict[str, float]:
        """The KV cache's figures as the worker's /stats reports them."""
        return {
            "num_free_blocks": self.num_free_blocks,
            "num_total_blocks": self.num_total_blocks,
            "usage": self.kv_usage,
        }


@dataclass
class StepRecord:
    step: int
    start: float  # time.monotonic() when scheduling began
    schedule_time: float  # seconds spent in the scheduler
    execute_time: float  # seconds in input preparation, the model and sampling
    stats: SchedulerStats
    # (request id, scheduled tokens, computed before this step) in batch order.
    batch: list[tuple[str, int, int]] = field(default_factory=list)
    prepare_time: float = 0.0  # seconds of execute_time spent packing inputs

    @property
    def duration(self) -> float:
        return self.schedule_time + self.execute_time

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled this step (the batch's rows before padding)."""
        return sum(n for _, n, _ in self.batch)

    @property
    def sum_context(self) -> int:
        """Each row's context after this step, summed: what attention reads (the cost model's term)."""
        return sum(n + done for _, n, done in self.batch)


@dataclass
class RequestRecord:
    request_id: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    arrival: float
    first_scheduled: float | None
    prefill_done: float | None
    first_token: float | None
    finished: float | None
    num_preemptions: int
    queue_time: float | None
    ttft: float | None
    tpot: float | None
    priority: int = 0
    # (event, time.monotonic(), attributes): see Request.events.
    events: list[tuple[str, float, dict[str, int | str]]] = field(default_factory=list)

    @classmethod
    def from_request(cls, r: Request) -> RequestRecord:
        t = r.timeline
        return cls(
            request_id=r.request_id,
            finish_reason=r.status.finish_reason,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_new_output_tokens,
            num_cached_tokens=r.num_cached_tokens,
            arrival=t.arrival,
            first_scheduled=t.first_scheduled,
            prefill_done=t.prefill_done,
            first_token=t.first_token,
            finished=t.finished,
            num_preemptions=t.num_preemptions,
            queue_time=t.queue_time,
            ttft=t.ttft,
            tpot=t.tpot(r.num_new_output_tokens),
            priority=r.priority,
            events=list(r.events),
        )


class EngineStatsSource(Protocol):
    """What exporters attach to: ``LLMEngine``, ``AsyncLLMEngine`` or ``EngineCoreClient`` (whose
    records arrive from the core process with each step's outputs)."""

    @property
    def metrics(self) -> EngineMetrics: ...

    @property
    def load(self) -> SchedulerStats: ...


class EngineMetrics:
    """Keeps the last ``history`` steps and calls listeners; exporters subscribe, nothing polls."""

    def __init__(self, history: int = 4096) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.request_listeners: list[Callable[[RequestRecord], None]] = []
        self.num_steps = 0
        self.num_finished = 0
        self.started = time.monotonic()

    def on_step(self, record: StepRecord) -> None:
        self.num_steps += 1
        self.steps.append(record)
        for listener in self.step_listeners:
            listener(record)

    def on_finished(self, request: Request) -> None:
        if self.request_listeners:
            self.on_request_record(RequestRecord.from_request(request))
        else:
            self.num_finished += 1

    def on_request_record(self, record: RequestRecord) -> None:
        """A finished request's record, built here or received from an engine core in another process."""
        self.num_finished += 1
        for listener in self.request_listeners:
            listener(record)
