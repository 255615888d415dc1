"""Redis key and channel names, in one place so gateway and worker can never disagree.

Per-request keys share a hash tag (``{id}``) so a Lua script touching several of them stays valid on
Redis Cluster, where a script may only touch keys of one slot.

    inflight:req:{id}          hash    the record: status, kind, model, timings, result (TTL)
    inflight:req:{id}:log      list    every event published for the request, in sequence order (TTL)
    inflight:req:{id}:owner    string  the worker generating it now; a lease that lapses (PX)
    inflight:req:{id}:cancel   string  set when a client cancels; read by the worker on consume (TTL)
    inflight:events:{id}       channel token events, live (pub/sub)
    inflight:cancel            channel request ids to cancel, heard by every worker
    inflight:pending           zset    admitted, not yet taken by an engine: member id, score expiry ms
    inflight:gateway:{id}      string  a gateway's liveness, renewed every second (TTL): the origin of
                                       a synchronous request (its record's "origin") is gone without it
    inflight:workers:{topic}   zset    workers consuming the topic now: member worker id, score the
                                       expiry (ms) of its last heartbeat (the key has a TTL too)
    inflight:dead:{id}         hash    a request failed because engines kept dying under it (engine_failed):
                                       what an operator needs to find it and its Kafka message (TTL)
    inflight:dead              zset    those requests' ids, scored by when they failed (TTL)
"""

from __future__ import annotations

PREFIX = "inflight"
PENDING = f"{PREFIX}:pending"
CANCEL_CHANNEL = f"{PREFIX}:cancel"
DEAD_LETTERS = f"{PREFIX}:dead"


def gateway_alive(instance_id: str) -> str:
    return f"{PREFIX}:gateway:{instance_id}"


def dead_letter(request_id: str) -> str:
    return f"{PREFIX}:dead:{{{request_id}}}"


def record(request_id: str) -> str:
    return f"{PREFIX}:req:{{{request_id}}}"


def log(request_id: str) -> str:
    return f"{PREFIX}:req:{{{request_id}}}:log"


def owner(request_id: str) -> str:
    return f"{PREFIX}:req:{{{request_id}}}:owner"


def cancel(request_id: str) -> str:
    return f"{PREFIX}:req:{{{request_id}}}:cancel"


def events(request_id: str) -> str:
    return f"{PREFIX}:events:{{{request_id}}}"


def request_keys(request_id: str) -> list[str]:
    """The keys the request scripts take, in the order they expect them (KEYS[1..4])."""
    return [record(request_id), log(request_id), owner(request_id), cancel(request_id)]


def workers(topic: str) -> str:
    return f"{PREFIX}:workers:{topic}"
