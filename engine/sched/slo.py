"""The ``slo`` policy: waiting requests by slack, prefill chunks sized to hold running TPOT deadlines.

Urgency of a waiting request at time ``now`` (smaller first), a (class, instant) pair:

    class 0  starving (waited >= slo_starvation_s) or resumed after a preemption mid-stream: by arrival
    class 1  its TTFT deadline can still be met: by latest start = deadline - estimated prefill time
             (the same order as slack = latest start - now); no deadline: latest start =
             arrival + slo_starvation_s, so it is never passed over forever
    class 2  lost: by arrival, served when nothing else waits, or with slo_reject finished at once
             with an error so it stops taking capacity. Lost means its first token cannot come before
             its deadline even if it ran alone now, or (with the running batch known: ``reorder``)
             once the prefills ahead of it in this order have run: the queue is walked in urgency
             order, and a request whose projected first token is late is moved here instead of
             pushing every request behind it late too (EDF's domino effect under overload)

Example, cost 10 ms fixed + 0.1 ms a token, now = 1.0 s: A arrived 0.2 s, TTFT 1 s, 500 tokens
(prefill ~60 ms: latest start 1.14 s); B arrived 0.9 s, TTFT 0.3 s, 100 tokens (~20 ms: 1.18 s);
C arrived 0.1 s, TTFT 0.9 s, 500 tokens (1.0 + 0.06 > 1.0: lost). Order: A, B, C.

Chunk sizing: once a running request has produced its first token, its TPOT deadline bounds every
step (a step is at least one token of latency for every running row). The step's predicted time must
stay within the smallest such deadline, so each prefill chunk is cut to what the cost model says still
fits. One chunk of at least a block still runs each step, so decodes can never starve prefills.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from engine.cost_model import StepCostModel
from engine.request import Request


def prefill_estimate(request: Request, cost: StepCostModel | None, budget: int) -> float:
    """Seconds to prefill what the request has left, alone, in chunks of at most ``budget`` tokens."""
    if cost is None:
        return 0.0
    remaining = max(1, request.num_tokens - request.num_computed_tokens)
    num_chunks = math.ceil(remaining / budget)
    return cost.step_time(remaining, num_chunks, remaining) + (num_chunks - 1) * cost.fixed


def ttft_deadline(request: Request) -> float | None:
    if request.slo_ttft_s is None or request.timeline.first_token is not None:
        return None
    return request.timeline.arrival + request.slo_ttft_s


def is_lost(request: Request, now: float, cost: StepCostModel | None, budget: int) -> bool:
    """Its first token can no longer come before its TTFT deadline, even if it ran alone now."""
    deadline = ttft_deadline(request)
    return deadline is not None and now + prefill_estimate(request, cost, budget) > deadline


class SLOQueue:
    """Waiting requests in urgency order as of the last ``reorder(now)`` (see the module docstring)."""

    def __init__(self, cost: StepCostModel | None, budget: int, starvation_s: float) -> None:
        self.cost = cost
        self.budget = budget
        self.starvation_s = starvation_s
        self._now = -math.inf
        self._items: list[Request] = []
        self._sorted = True
        self._running: tuple[int, int] | None = None  # (rows, context) of the batch, if known
        self._lost: list[Request] = []

    def urgency(self, request: Request) -> tuple[int, float]:
        arrival = request.timeline.arrival
        if self._now - arrival >= self.starvation_s or request.timeline.first_token is not None:
            return (0, arrival)
        deadline = ttft_deadline(request)
        if deadline is None:
            return (1, arrival + self.starvation_s)
        latest_start = deadline - prefill_estimate(request, self.cost, self.budget)
        return (1, latest_start) if latest_start >= self._now else (2, arrival)

    def reorder(self, now: float, running: tuple[int, int] | None = None) -> None:
        """Order as of ``now``; ``running`` = (rows, summed context) of the batch the prefills will
        share steps with, which makes the order queue-aware (see the module docstring)."""
        self._now = now
        self._running = running
        self._sorted = False

    def _sort(self) -> None:
        if self._sorted:
            return
        keys = {id(r): self.urgency(r) for r in self._items}
        self._items.sort(key=lambda r: keys[id(r)])  # stable: ties keep arrival order
        if self.cost is not None and self._running is not None and self._queue_aware(keys):
            self._items.sort(key=lambda r: keys[id(r)])  # the newly lost move behind
        self._lost = [r for r in self._items if keys[id(r)][0] == 2 and ttft_deadline(r) is not None]
        self._sorted = True

    def _queue_aware(self, keys: dict[int, tuple[int, float]]) -> bool:
        """Walk the queue (sorted by ``keys``), projecting when each first token comes if the
        prefills ahead run first, ``budget`` tokens a step next to the running rows; a request
        projected late goes to class 2 and takes no place in the projection. True if any did."""
        assert self.cost is not None and self._running is not None
        rows, context = self._running
        step = self.cost.step_time(self.budget + rows, rows + 1, context + self.budget)
        ahead = 0  # prefill tokens of the requests kept ahead
        moved = False
        for r in self._items:
            if keys[id(r)][0] == 2:
                continue
            remaining = max(1, r.num_tokens - r.num_computed_tokens)
            deadline = ttft_deadline(r)
            # Whole steps of a full chunk; the last one partly full is still a whole step.
            done = self._now + math.ceil((ahead + remaining) / self.budget) * step
            if deadline is not None and keys[id(r)][0] == 1 and done > deadline:
                keys[id(r)] = (2, r.timeline.arrival)
                moved = True
                continue
            ahead += remaining
        return moved

    def lost(self) -> list[Request]:
        """Waiting requests whose TTFT deadline is lost, as of the last ``reorder``."""
        self._sort()
        return list(self._lost)

    def add(self, request: Request) -> None:
        self._items.append(request)
        self._sorted = False

    # Urgency decides a preempted request's place like any other's.
    add_front = add

    def peek(self) -> Request:
        self._sort()
        return self._items[0]

    def pop(self) -> Request:
        self._sort()
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        self._sort()
        return iter(list(self._items))


def step_time_cap(running: list[Request]) -> float | None:
    """The tightest TPOT deadline among running requests already streaming tokens (None: no bound).

    Async scheduling: a first token still in flight (a placeholder) counts; the request decodes now.
    """
    caps = [
        r.slo_tpot_s
        for r in running
        if r.slo_tpot_s is not None and (r.timeline.first_token is not None or r.num_output_placeholders)
    ]
    return min(caps) if caps else None


def lost_message(request: Request, now: float, cost: StepCostModel | None, budget: int) -> str:
    assert request.slo_ttft_s is not None
    waited = now - request.timeline.arrival
    need = prefill_estimate(request, cost, budget)
    why = "" if is_lost(request, now, cost, budget) else ", after the prefills of more urgent requests"
    return (
        f"slo_ttft_unmet: the time-to-first-token deadline of {request.slo_ttft_s * 1e3:.0f} ms can no "
        f"longer be met (waited {waited * 1e3:.0f} ms, prefill needs about {need * 1e3:.0f} ms{why}); "
        "rejected early by the slo policy (slo_reject)"
    )
