"""Offset commits: past requests that are all terminal, coalesced, and once more on every rebalance."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from services.common.kafka import log_holds
from services.worker.offsets import OffsetTracker

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 5.0
COALESCE_S = 0.05  # a burst of finishing requests becomes one commit


class Committer:
    def __init__(
        self, tracker: OffsetTracker, make_probe: Callable[[], AIOKafkaConsumer] | None = None
    ) -> None:
        self.tracker = tracker
        self.consumer: AIOKafkaConsumer | None = None  # set once the consumer exists
        self._make_probe = make_probe
        self._probe: AIOKafkaConsumer | None = None  # started on the first suspicious end offset
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Some offsets may have become committable: commit soon."""
        self._wake.set()

    async def commit_now(self) -> None:
        offsets = self.tracker.committable()
        if not offsets or self.consumer is None:
            return
        try:
            # A position past the partition's end means the log is not the one the offsets came from
            # (a broker that lost its log): committing it would skip new messages. Bounded in time,
            # because aiokafka retries a commit for as long as the broker lets it, and the rebalance
            # listener awaits this.
            ends = await asyncio.wait_for(self.consumer.end_offsets(list(offsets)), COMMIT_TIMEOUT_S)
            suspects = {tp for tp, position in offsets.items() if position > ends.get(tp, position)}
            # Reading the log back is bounded too: a timeout commits nothing this round (below).
            stale = await asyncio.wait_for(self._gone(suspects), COMMIT_TIMEOUT_S) if suspects else set()
            if stale:
                log.warning("not committing past the end of %s: the broker lost its log", sorted(stale))
                self.tracker.forget(stale)
                offsets = {tp: p for tp, p in offsets.items() if tp not in stale}
            if offsets:
                await asyncio.wait_for(self.consumer.commit(offsets), COMMIT_TIMEOUT_S)
                self.tracker.mark_committed(offsets)
        except (KafkaError, TimeoutError) as exc:
            # Not fatal: the offsets are committed with the next success, or the requests are
            # redelivered after a rebalance and skipped as terminal.
            log.warning("commit failed: %r", exc)

    async def _gone(self, suspects: set[TopicPartition]) -> set[TopicPartition]:
        return {tp for tp in suspects if not await self._still_there(tp)}

    async def _still_there(self, tp: TopicPartition) -> bool:
        """Read the last message the commit passes: an end offset that lags a record batch (tansu's)
        is not a lost log."""
        last = self.tracker.last_finished(tp)
        if last is None or self._make_probe is None:
            return False
        if self._probe is None:
            self._probe = self._make_probe()
            await self._probe.start()
        return await log_holds(self._probe, tp, *last)

    async def close(self) -> None:
        if self._probe is not None:
            with contextlib.suppress(KafkaError, OSError):
                await self._probe.stop()
            self._probe = None

    async def run_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            self._wake.clear()
            await self.commit_now()
            await asyncio.sleep(COALESCE_S)


class RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, committer: Committer) -> None:
        self.committer = committer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.committer.commit_now()  # last chance to commit these partitions' finished prefix
        self.committer.tracker.forget(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        # Eager rebalancing revokes everything first, and the consumer re-reads every assigned partition
        # from its committed offset: requests still running here are redelivered and reattach.
        self.committer.tracker.reset(assigned)
        log.info("assigned partitions %s", sorted(tp.partition for tp in assigned))
