"""The worker's only use of aiokafka internals, kept here so an aiokafka upgrade has one place to check."""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer
from aiokafka.protocol.group import LeaveGroupRequest

log = logging.getLogger(__name__)


async def leave_first_generation(consumer: AIOKafkaConsumer) -> None:
    """Send LeaveGroup for a member of generation 0, which aiokafka itself never does.

    aiokafka reads generation 0 as "never joined" (Kafka numbers generations from 1), but tansu's first
    generation is 0: without this, a worker that drains before any rebalance leaves its partitions
    stranded until its session times out, instead of handing them over at once.
    """
    coordinator = getattr(consumer, "_coordinator", None)  # private: aiokafka has no public handle
    if coordinator is None or coordinator.generation != 0 or not coordinator.member_id:
        return
    try:
        await coordinator._send_req(LeaveGroupRequest(coordinator.group_id, coordinator.member_id))
    except Exception as exc:  # best effort, like aiokafka's own leave
        log.warning("LeaveGroup failed: %r", exc)


def set_fetch_wait(consumer: AIOKafkaConsumer, wait_ms: int) -> None:
    """Change the consumer's ``fetch_max_wait_ms`` for its next fetch requests.

    aiokafka fixes it at construction but reads it afresh for every FetchRequest it builds, so setting
    its fetcher's copy takes effect at the next fetch (the one in flight keeps its own). Without a
    fetcher (not started, or a newer aiokafka that renamed it) nothing changes: short fetches go on.
    """
    fetcher = getattr(consumer, "_fetcher", None)  # private: aiokafka has no public setter
    if fetcher is not None and hasattr(fetcher, "_fetch_max_wait_ms"):
        fetcher._fetch_max_wait_ms = wait_ms
