"""Kafka clients configured from settings, topic creation, and the message key (trace context headers:
services.common.tracing)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    OffsetOutOfRangeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import TopicPartition

from services.common.settings import Settings

log = logging.getLogger(__name__)

# A message the producer or the broker refuses for its size: retrying cannot help (the gateway answers 413).
MESSAGE_TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError)


def client_kwargs(settings: Settings) -> dict[str, Any]:
    """Connection and security options every client shares."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "security_protocol": settings.kafka_security_protocol,
    }
    if settings.kafka_security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context()
    if settings.kafka_sasl_mechanism:
        kwargs.update(
            sasl_mechanism=settings.kafka_sasl_mechanism,
            sasl_plain_username=settings.kafka_sasl_username,
            sasl_plain_password=settings.kafka_sasl_password,
        )
    return kwargs


def max_message_bytes(settings: Settings) -> int:
    """The largest request message that producer, topic and consumer all accept.

    A request message re-encodes the body as ASCII JSON (non-ASCII text can grow to 3x, token ids
    replace text): twice the body limit plus room for the envelope covers every ordinary body. The
    gateway answers 413 at once for a message still larger, instead of a produce that times out.
    """
    return 2 * settings.max_body_bytes + 256 * 1024


def make_producer(settings: Settings) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        **client_kwargs(settings),
        acks="all",
        max_request_size=max_message_bytes(settings),
        enable_idempotence=settings.kafka_idempotence,
        linger_ms=0,  # a request is latency-bound; batching happens naturally under load
        request_timeout_ms=max(1000, int(settings.kafka_produce_timeout_s * 1000)),
    )


def heartbeat_interval_ms(session_timeout_ms: int) -> int:
    """A fifth of the session: a dead worker's partitions move on about a session plus a heartbeat after
    its last beat (a survivor learns of the rebalance at its next heartbeat), and four beats may be lost
    before a live worker is taken for dead."""
    return max(100, session_timeout_ms // 5)


def fit_session(wanted_ms: int, broker_min_ms: int | None, broker_max_ms: int | None) -> int:
    """The session timeout to ask for: ``wanted_ms`` moved inside the broker's bounds, saying so.

    A JoinGroup whose session lies outside the coordinator's ``group.min.session.timeout.ms`` /
    ``group.max.session.timeout.ms`` is refused (INVALID_SESSION_TIMEOUT) and the worker could never
    join; Apache Kafka's default minimum (6 s) is above this project's default (2 s)."""
    fitted = wanted_ms
    if broker_min_ms is not None and fitted < broker_min_ms:
        fitted = broker_min_ms
    if broker_max_ms is not None and fitted > broker_max_ms:
        fitted = broker_max_ms
    if fitted != wanted_ms:
        log.warning(
            "INFLIGHT_KAFKA_SESSION_TIMEOUT_MS=%d is outside the broker's group session bounds [%s, %s]: "
            "using %d ms (a dead worker's requests then wait about that long to move; lower the broker's "
            "group.min.session.timeout.ms for faster recovery)",
            wanted_ms, broker_min_ms, broker_max_ms, fitted,
        )  # fmt: skip
    return fitted


async def broker_session_timeout_ms(settings: Settings) -> int:
    """``settings.kafka_session_timeout_ms`` fitted to the broker's group session bounds, read with
    DescribeConfigs; a broker that does not answer (tansu, restricted ACLs) leaves it as it is."""
    wanted = settings.kafka_session_timeout_ms
    admin = make_admin(settings)
    try:
        await admin.start()
        brokers = (await admin.describe_cluster())["brokers"]
        node = str(brokers[0]["node_id"])
        (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, node)])
        entries = response.resources[0][4]  # (error_code, error_message, type, name, config_entries)
        found = {e[0]: int(e[1]) for e in entries if str(e[1]).isdigit()}
    except Exception as exc:  # the bounds are advice: never fail a start-up over reading them
        log.debug("could not read the broker's group session bounds: %r", exc)
        return wanted
    finally:
        await admin.close()
    return fit_session(
        wanted, found.get("group.min.session.timeout.ms"), found.get("group.max.session.timeout.ms")
    )


def make_consumer(settings: Settings, session_timeout_ms: int | None = None) -> AIOKafkaConsumer:
    # The session timeout is how long a SIGKILLed worker's partitions (and the requests in them) wait
    # before a rebalance hands them on: the worker's loop never runs a model step (the engine core has a
    # process of its own), so its heartbeats keep time and a short session is safe. ``session_timeout_ms``:
    # the setting as fitted to the broker (``broker_session_timeout_ms``).
    session = session_timeout_ms or settings.kafka_session_timeout_ms
    return AIOKafkaConsumer(
        **client_kwargs(settings),
        group_id=settings.kafka_consumer_group,
        enable_auto_commit=False,  # offsets move only past terminal requests (at-least-once)
        # A group without committed offsets (first start, or a broker that lost them) reads from the
        # start: a request is redelivered rather than silently skipped, and redelivery is harmless.
        auto_offset_reset="earliest",
        fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
        session_timeout_ms=session,
        heartbeat_interval_ms=heartbeat_interval_ms(session),
        # How long a live member may take to rejoin a rebalance (its revoke callback commits first);
        # a dead one is dropped after its session anyway, so a generous bound costs no recovery time.
        rebalance_timeout_ms=max(session, 30_000),
        max_poll_interval_ms=max(session * 3, 60_000),
        metadata_max_age_ms=30_000,
        # One message may be as large as the producer allows: a fetch must be able to hold it.
        max_partition_fetch_bytes=max_message_bytes(settings),
        fetch_max_bytes=max(52_428_800, max_message_bytes(settings)),
    )


def make_probe(settings: Settings) -> AIOKafkaConsumer:
    """A group-less consumer for reading end offsets and single messages (never part of the group)."""
    return AIOKafkaConsumer(
        **client_kwargs(settings),
        enable_auto_commit=False,
        auto_offset_reset="none",  # a position past the log's end must say so, not jump
        fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
        max_partition_fetch_bytes=max_message_bytes(settings),
    )


async def topic_partitions(probe: AIOKafkaConsumer, topic: str, timeout_s: float = 5.0) -> set[int]:
    """The partitions ``topic`` has now, from fresh metadata (empty when the broker does not know it).

    A broker that lost its topics (tansu's memory storage, a topic deleted by an operator) may have it
    back with another partition count (auto-created with the broker's default): a message on a partition
    that no longer exists is lost, and asking for that partition's end offset only times out."""
    client = probe._client  # aiokafka has no public call for one topic's fresh metadata
    client.add_topic(topic)
    await asyncio.wait_for(client.force_metadata_update(), timeout_s)
    return set(client.cluster.partitions_for_topic(topic) or ())


async def refresh_producer_metadata(producer: AIOKafkaProducer, timeout_s: float = 5.0) -> None:
    """Fresh metadata before producing a message again: a producer keeps the partition count it last saw
    (for minutes), and a topic back from a broker that lost it may have fewer partitions; a keyed message
    sent to one that no longer exists is accepted by some brokers (tansu) and read by no consumer."""
    await asyncio.wait_for(producer.client.force_metadata_update(), timeout_s)


async def log_holds(
    probe: AIOKafkaConsumer, tp: TopicPartition, offset: int, key: bytes | None, timeout_s: float = 2.0
) -> bool:
    """Does ``tp``'s log still hold the message ``key`` at ``offset``?

    The end offset alone cannot say: a log lost and refilled past ``offset`` holds another message
    there, and tansu (the test broker) answers ListOffsets with the base offset of the last record
    batch plus one, so a message produced in a batch behind another looks past the end. Reading the
    message answers both. ``key`` None: any message at ``offset`` will do.
    """
    probe.assign([tp])
    probe.seek(tp, offset)
    try:
        batch = await probe.getmany(tp, timeout_ms=int(timeout_s * 1000), max_records=1)
    except OffsetOutOfRangeError:
        return False
    records = batch.get(tp, [])
    return bool(records) and records[0].offset == offset and (key is None or records[0].key == key)


def make_admin(settings: Settings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**client_kwargs(settings), request_timeout_ms=5000)


async def ensure_topic(settings: Settings) -> None:
    """Create the request topic if it is missing; an existing topic is left as it is.

    Create first, and learn from the answer whether it existed: a metadata request (describing the topic)
    would auto-create a missing topic on a broker with ``auto.create.topics.enable`` (tansu's default),
    with the broker's partition count instead of ``kafka_partitions``. A create that finds the topic
    (one auto-created by a client's metadata request included) keeps it and its messages."""
    admin = make_admin(settings)
    await admin.start()
    try:
        topic = NewTopic(
            settings.kafka_topic,
            settings.kafka_partitions,
            settings.kafka_replication_factor,
            topic_configs={
                # The broker's default (about 1 MiB) would refuse the larger bodies the gateway accepts.
                "max.message.bytes": str(max_message_bytes(settings)),
                # Prompts are kept as long as a request may wait, not the broker's week (settings.py).
                "retention.ms": str(settings.kafka_retention_ms),
            },
        )
        try:
            response = await admin.create_topics([topic])
            entry = response.topic_errors[0]  # (topic, error code[, message]) by protocol version
            code, message = entry[1], entry[2] if len(entry) > 2 else None
        except TopicAlreadyExistsError:  # a client that raises instead of answering the code
            code, message = TopicAlreadyExistsError.errno, None
        if code == 0:
            log.info("created topic %s with %d partitions", settings.kafka_topic, settings.kafka_partitions)
        elif code == TopicAlreadyExistsError.errno:  # another replica's, an operator's, or auto-created
            await _check_message_limit(admin, settings)
        else:
            raise KafkaError(f"creating topic {settings.kafka_topic} failed: error {code} ({message})")
    finally:
        await admin.close()


async def _check_message_limit(admin: AIOKafkaAdminClient, settings: Settings) -> None:
    """Warn when an existing topic (created by someone else) takes smaller messages than the body limit
    needs: such requests are refused by the broker (413), which an operator should hear about at start."""
    try:
        (response,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, settings.kafka_topic)]
        )
        entries = response.resources[0][4]  # (error_code, error_message, type, name, config_entries)
    except Exception as exc:  # only a warning is at stake: never fail a start-up over it
        log.debug("could not read topic %s's max.message.bytes: %r", settings.kafka_topic, exc)
        return
    for entry in entries:
        if entry[0] == "max.message.bytes" and str(entry[1]).isdigit():
            limit, needed = int(entry[1]), max_message_bytes(settings)
            if limit < needed:
                log.warning(
                    "topic %s takes messages up to %d bytes; bodies up to INFLIGHT_MAX_BODY_BYTES=%d need "
                    "%d: larger requests will be refused (413). Raise the topic's max.message.bytes.",
                    settings.kafka_topic, limit, settings.max_body_bytes, needed,
                )  # fmt: skip


def affinity_key(
    prompt_token_ids: Sequence[int], block_tokens: int, session: str | None = None, text: str = ""
) -> bytes:
    """The message key: requests with one key land on one partition, hence one engine's prefix cache.

    A client session id wins (a conversation's turns share ever longer prefixes); otherwise the first
    full block of prompt tokens, the unit the engine's prefix cache hashes; a gateway without the
    tokenizer uses the first characters of the text instead (about a block's worth).
    """
    digest = hashlib.blake2b(digest_size=8)
    if session:
        digest.update(b"s:" + session.encode())
    elif prompt_token_ids:
        digest.update(b"p:" + ",".join(map(str, prompt_token_ids[:block_tokens])).encode())
    else:
        digest.update(b"t:" + text[: block_tokens * 4].encode())
    return digest.hexdigest().encode()
