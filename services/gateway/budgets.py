"""What one API key may hold on one gateway: synchronous requests in flight, and bytes of queued messages.

    INFLIGHT_MAX_CONCURRENT_PER_KEY     completions in flight per key (a batched prompt: one per prompt)
    INFLIGHT_MAX_QUEUED_BYTES           request messages this gateway holds until an engine takes them
    INFLIGHT_MAX_QUEUED_BYTES_PER_KEY   the same, per key

Both are this gateway's own state, counted in memory: a slot is taken before admission and given back
exactly once (``Slot.release``, idempotent), when the request's subscription is dropped or its message
leaves the dispatcher's queue. A refusal is 429 with ``Retry-After`` (413 for a message that could never
fit), counted in ``inflight:admission_rejections_total{reason}``; the gauges show what is held now. Keys
are owner digests (edge.key_owner), never the key itself; without API keys every client shares "".
"""

from __future__ import annotations

from collections.abc import Callable

from services.common.metrics import service_families
from services.gateway.errors import APIError

# admission_rejections_total reasons: a fixed set, so refusals never add series per key.
KEY_CONCURRENCY = "key_concurrency"
QUEUED_BYTES = "queued_bytes"
KEY_QUEUED_BYTES = "key_queued_bytes"
KEY_STORED_JOBS = "key_stored_jobs"
KEY_JOBS = "key_jobs"


def refuse(reason: str, message: str, retry_after_s: int = 1) -> APIError:
    """A 429 for a budget, counted by reason."""
    service_families().admission_rejections.labels(reason).inc()
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


class Slot:
    """One unit taken from a budget; ``release`` gives it back once, however often it is called."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back: Callable[[], None] | None = give_back

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()


class KeyBudgets:
    def __init__(
        self, max_concurrent_per_key: int, max_queued_bytes: int, max_queued_bytes_per_key: int
    ) -> None:
        self.max_concurrent_per_key = max_concurrent_per_key
        self.max_queued_bytes = max_queued_bytes
        self.max_queued_bytes_per_key = max_queued_bytes_per_key
        self._in_flight: dict[str, int] = {}  # owner -> synchronous requests in flight
        self._queued: dict[str, int] = {}  # owner -> bytes of its queued messages
        self.queued_bytes = 0  # over all owners

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight.values())

    def in_flight_of(self, owner: str) -> int:
        return self._in_flight.get(owner, 0)

    def queued_of(self, owner: str) -> int:
        return self._queued.get(owner, 0)

    def enter(self, owner: str) -> Slot:
        """A synchronous request of ``owner`` starts; 429 past its concurrency budget."""
        held = self._in_flight.get(owner, 0)
        if held >= self.max_concurrent_per_key:
            raise refuse(
                KEY_CONCURRENCY,
                f"this API key has {held} requests in flight on this gateway, its limit "
                f"(INFLIGHT_MAX_CONCURRENT_PER_KEY={self.max_concurrent_per_key}); retry when one finishes",
            )
        self._in_flight[owner] = held + 1

        def leave() -> None:
            left = self._in_flight[owner] - 1
            if left:
                self._in_flight[owner] = left
            else:
                del self._in_flight[owner]  # no entry per key that once sent a request

        return Slot(leave)

    def hold(self, owner: str, num_bytes: int) -> Slot:
        """Hold ``num_bytes`` of ``owner``'s message until an engine takes it: 413 for a message over a
        bound (it could never be held), 429 while the bytes already held leave no room for it."""
        bound = min(self.max_queued_bytes, self.max_queued_bytes_per_key)
        if num_bytes > bound:
            raise APIError(
                413,
                f"this request encodes to {num_bytes} bytes, over the {bound} a gateway queues for one key",
                code="request_too_large",
            )
        mine = self._queued.get(owner, 0)
        if mine + num_bytes > self.max_queued_bytes_per_key:
            raise refuse(
                KEY_QUEUED_BYTES,
                f"this API key's queued requests hold {mine} bytes on this gateway; {num_bytes} more would "
                f"pass its limit of {self.max_queued_bytes_per_key}; retry once engines take some",
            )
        if self.queued_bytes + num_bytes > self.max_queued_bytes:
            raise refuse(
                QUEUED_BYTES,
                f"this gateway holds {self.queued_bytes} bytes of queued requests; {num_bytes} more would "
                f"pass its limit of {self.max_queued_bytes}; retry shortly",
            )
        self._queued[owner] = mine + num_bytes
        self.queued_bytes += num_bytes

        def give_back() -> None:
            left = self._queued[owner] - num_bytes
            if left:
                self._queued[owner] = left
            else:
                del self._queued[owner]
            self.queued_bytes -= num_bytes

        return Slot(give_back)
