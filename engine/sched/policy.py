"""Waiting-queue orders: fcfs (arrival) and priority (lower value first, ties by arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine.request import Request


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_front(self, request: Request) -> None:
        # A preempted request arrived before everything still waiting: it goes first.
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


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


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
