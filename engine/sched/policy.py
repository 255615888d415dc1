"""Scheduling policies: what the scheduler asks of one, and the two that need no cost model.

The scheduler owns the mechanics (one token budget a step, running requests first, blocks, preemption)
and asks its policy, chosen once from ``scheduling_policy``, every question whose answer is a matter
of policy. It never branches on which policy it holds:

    begin_step         order the waiting queue (and the running list) as of now; name waiting
                       requests to reject, each with the error it finishes with
    cap_chunk          how many of a request's next tokens this step may take
    admits             whether a waiting request may take a seat now
    victim             which running request gives up its blocks when they run out
    displaces          a running request to preempt so that a waiting one can join
    end_step           the step is planned: record what the policy plans with next
    observe_step_time  a step ran: its measured time next to what the plan expected

``SchedulingPolicy`` answers as fcfs does: arrival order (background work after the rest), whole
chunks, every request admitted, the most recently admitted preempted. ``PriorityPolicy`` orders by
priority and lets an urgent request displace a less urgent one; ``SLOPolicy``
(engine/sched/slo_policy.py) plans against deadlines.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from engine.config import EngineConfig
from engine.cost_model import StepCostModel
from engine.request import Request
from engine.sched.output import SchedulerOutput


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


# Background work (a batch's lines: the gateway's BATCH_PRIORITY) sets at least this priority. fcfs keeps
# arrival order but for it: it waits behind every other waiting request, so a batch queued first does not
# hold back interactive requests that arrive after it. (priority and slo order by priority anyway.)
BACKGROUND_PRIORITY = 1_000_000


class FCFSQueue:
    """Arrival order, in two bands: foreground requests, then background ones (``BACKGROUND_PRIORITY``).
    Worked example, arrivals b1 b2 (background) then i1 (interactive): the order is i1 b1 b2."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()
        self._background: deque[Request] = deque()

    def _band(self, request: Request) -> deque[Request]:
        return self._background if request.priority >= BACKGROUND_PRIORITY else self._q

    def add(self, request: Request) -> None:
        self._band(request).append(request)

    def add_front(self, request: Request) -> None:
        # A preempted request arrived before everything still waiting in its band: it goes first there.
        self._band(request).appendleft(request)

    def peek(self) -> Request:
        return self._q[0] if self._q else self._background[0]

    def pop(self) -> Request:
        return self._q.popleft() if self._q else self._background.popleft()

    def remove(self, request: Request) -> None:
        self._band(request).remove(request)

    def __len__(self) -> int:
        return len(self._q) + len(self._background)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self._q, self._background)


def priority_key(request: Request) -> tuple[int, float]:
    """Smaller is more urgent."""
    return (request.priority, request.timeline.arrival)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tie = itertools.count()

    def add(self, request: Request) -> None:
        prio, arrival = priority_key(request)
        heapq.heappush(self._heap, (prio, arrival, next(self._tie), request))

    # The heap already orders a preempted request by its original arrival.
    add_front = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        # O(n), but only aborts of waiting requests take this path.
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


class SchedulingPolicy:
    """The policy interface, answered as fcfs does (see the module docstring).

    Background work steps aside once per foreground arrival: when the most urgent waiting request is a
    foreground one the policy has not stepped aside for yet, and a seat is free, that step schedules no
    background request, so the newcomer's prefill runs without the background batch's decodes and
    chunks beside it (a batch's lines cost an interactive request's first token little). Once per
    arrival, so background work always progresses: a newcomer the KV cache cannot take yet does not
    hold it back for more than one step.
    """

    def __init__(self, max_num_seqs: int | None = None) -> None:
        self.waiting: WaitingQueue = FCFSQueue()
        self._max_num_seqs = max_num_seqs  # None: background work never steps aside
        self._stepped_aside_for: str | None = None  # the newcomer the last step-aside was for
        self._hold_background = False  # this step schedules no background request

    def begin_step(
        self, running: list[Request], now: float, tokens_left: Callable[[Request], int]
    ) -> list[tuple[Request, str]]:
        """Before a step is scheduled: order the waiting queue (and ``running``, in place) as of
        ``now``. ``tokens_left(r)``: the tokens running request ``r`` has yet to compute. Returns the
        waiting requests to reject now, each with the error message it finishes with."""
        self._step_aside_for_a_newcomer(running)
        return []

    def _step_aside_for_a_newcomer(self, running: Sequence[Request]) -> None:
        self._hold_background = False
        if self._max_num_seqs is None or not len(self.waiting) or len(running) >= self._max_num_seqs:
            return
        head = self.waiting.peek()
        if head.priority >= BACKGROUND_PRIORITY or head.request_id == self._stepped_aside_for:
            return
        if any(r.priority >= BACKGROUND_PRIORITY for r in running):
            self._hold_background = True
            self._stepped_aside_for = head.request_id

    def cap_chunk(
        self, request: Request, num_new: int, out: SchedulerOutput, scheduled: Sequence[Request]
    ) -> int:
        """How many of the ``num_new`` tokens the budget allows ``request`` this step may take, next to
        the batch so far (``out``; ``scheduled``: its requests, in order). 0 or less: none."""
        if self._hold_background and request.priority >= BACKGROUND_PRIORITY:
            return 0
        return num_new

    def admits(self, request: Request, running: Sequence[Request]) -> bool:
        """Whether the next waiting request may join ``running`` now; False stops admission."""
        return True

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request preempted when blocks run out: the most recently admitted."""
        return running[-1]

    def displaces(self, request: Request, running: Sequence[Request]) -> Request | None:
        """A running request to preempt so that waiting ``request`` can join (no seat or no blocks)."""
        return None

    def end_step(self, out: SchedulerOutput, scheduled: Sequence[Request]) -> None:
        """The step ``out`` is planned (``scheduled``: its requests, before they advance)."""

    def observe_step_time(self, modelled_s: float, measured_s: float) -> None:
        """A step (or a run of steps, summed) took ``measured_s`` where the plan said ``modelled_s``
        (``SchedulerOutput.modelled_s``, 0 when the policy plans without a model)."""


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, ties by arrival; an urgent request displaces a less urgent one."""

    def __init__(self, max_num_seqs: int | None = None) -> None:
        super().__init__(max_num_seqs)
        self.waiting = PriorityQueue()

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=priority_key)

    def displaces(self, request: Request, running: Sequence[Request]) -> Request | None:
        if not running:
            return None
        victim = self.victim(running)
        return victim if victim.priority > request.priority else None


def make_policy(config: EngineConfig, cost: StepCostModel | None = None) -> SchedulingPolicy:
    """The policy ``config.scheduling_policy`` names; ``cost``: the step-cost model it may plan with."""
    from engine.sched.slo_policy import SLOPolicy  # it builds on this module

    if config.scheduling_policy == "fcfs":
        return SchedulingPolicy(config.max_num_seqs)
    if config.scheduling_policy == "priority":
        return PriorityPolicy(config.max_num_seqs)
    if config.scheduling_policy == "slo":
        return SLOPolicy(config, cost)
    raise ValueError(f"unknown scheduling policy {config.scheduling_policy!r}")
