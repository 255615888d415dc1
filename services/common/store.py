"""The request store in Redis: records, token logs, leases, the pending set, cancellation.

One typed wrapper over the Lua scripts of ``redis_scripts.py`` so that gateway and worker speak the same
protocol, and tests can drive it directly against a real Redis.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common import keys, redis_scripts
from services.common.settings import Settings
from services.common.wire import (
    CANCELLED,
    FAILED,
    QUEUED,
    CancelMessage,
    DoneEvent,
    Event,
    decode_event,
    encode_event,
)

# Every failure of a Redis call, not only a lost connection: a server over ``maxmemory`` (OOM) or one
# demoted to a replica by a failover (READONLY) answers with an error reply, and for the services that is
# the same as an outage: buffer, retry, answer 503, but never treat the request as settled.
REDIS_ERRORS = (RedisError, OSError)

_Queue = Callable[[Pipeline], object]  # queues one command on a pipeline
_SOCKET_TIMEOUT_S = 5.0


def connect_redis(settings: Settings) -> aioredis.Redis:
    # A couple of quick retries ride over a dropped pooled connection (a Redis restart); longer
    # outages surface as errors that callers turn into 503s or buffered publishing. The pool blocks
    # when all its connections are busy: redis-py's default pool raises at its 100th concurrent
    # command, which a burst of requests on one gateway reaches with Redis perfectly healthy.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=_SOCKET_TIMEOUT_S,
        password=settings.redis_password,
        decode_responses=True,
        socket_connect_timeout=2.0,
        socket_timeout=_SOCKET_TIMEOUT_S,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return aioredis.Redis.from_pool(pool)


@dataclass
class StartResult:
    """What a worker learns when it claims a request."""

    outcome: str  # "ok" | "busy" | "terminal"
    status: str | None = None  # terminal: the status; busy: the owner
    seed: int | None = None
    cancelled: bool = False
    epoch: int = 0  # ok: this claim's fencing token, passed to every later write (redis_scripts.py)
    events: list[Event] = field(default_factory=list)


class Store:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._shas: dict[str, str] = {}

    # ---- scripts ---------------------------------------------------------------------------
    async def _eval(self, script: str, keys_: Sequence[str], args: Sequence[Any]) -> Any:
        return (await self.eval_many([(script, keys_, args)]))[0]

    async def eval_many(
        self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]], *, before: Sequence[_Queue] = ()
    ) -> list[Any]:
        """Run several scripts in one round trip (EVALSHA in a pipeline, loading scripts on NOSCRIPT).

        ``before``: functions that queue plain commands on the pipeline first, in the same round trip;
        their replies are not returned.
        """
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for queue in before:
                queue(pipe)
            for script, keys_, args in calls:
                pipe.evalsha(self._sha(script), len(keys_), *keys_, *args)
            results = (await pipe.execute(raise_on_error=False))[len(before) :]
            # A restarted Redis has forgotten the scripts: load them and run the whole batch again
            # (scripts that did run are idempotent enough: at worst a delta is logged twice and
            # readers drop the duplicate by seq; a finish run again writes nothing, redis_scripts.PUBLISH).
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in results):
                for script in {c[0] for c in calls}:
                    self._shas[script] = await self.client.script_load(script)
                continue
            for r in results:
                if isinstance(r, Exception):
                    raise r
            return list(results)
        raise AssertionError("unreachable")

    def _sha(self, script: str) -> str:
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        return sha

    # ---- admission (gateway) ---------------------------------------------------------------
    async def admit_and_record(
        self,
        request_id: str,
        max_pending: int,
        pending_ttl_s: float,
        fields: dict[str, str | int | float],
        ttl_s: int,
    ) -> bool:
        """Admission and the queued record in one round trip (the latency of every request pays it).

        The record is written either way; a refused request's record is deleted right after, off the
        caller's path (the 429 answers at once).
        """
        record = {**fields, "status": QUEUED, "ttl": ttl_s}
        key = keys.record(request_id)
        before: list[_Queue] = [
            lambda p: p.hset(key, mapping=cast(Any, record)),
            lambda p: p.expire(key, ttl_s),
        ]
        (admitted,) = await self.eval_many(
            [(redis_scripts.ADMIT, [keys.PENDING], [request_id, max_pending, int(pending_ttl_s * 1000)])],
            before=before,
        )
        return bool(admitted)

    async def refresh_pending(self, request_ids: Sequence[str], ttl_s: float) -> set[str]:
        """Extend this gateway's reservations; returns the ids still pending (not yet taken)."""
        if not request_ids:
            return set()
        alive = await self._eval(
            redis_scripts.REFRESH_PENDING, [keys.PENDING], [int(ttl_s * 1000), *request_ids]
        )
        return set(alive)

    async def release_pending(self, request_id: str) -> None:
        await self.client.zrem(keys.PENDING, request_id)

    async def num_pending(self) -> int:
        return int(await self.client.zcount(keys.PENDING, int(time.time() * 1000), "+inf"))

    # ---- records ---------------------------------------------------------------------------
    async def create_record(self, request_id: str, fields: dict[str, str | int | float], ttl_s: int) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(keys.record(request_id), mapping=cast(Any, {**fields, "status": QUEUED, "ttl": ttl_s}))
        pipe.expire(keys.record(request_id), ttl_s)
        await pipe.execute()

    async def set_fields(
        self, request_id: str, fields: dict[str, str | int | float], default_ttl_s: int = 900
    ) -> bool:
        """Write fields of a record that exists and is not terminal, keeping (or restoring) its TTL
        (redis_scripts.SET_FIELDS); False when refused."""
        flat = [str(v) for kv in fields.items() for v in kv]
        args = [default_ttl_s, *flat]
        return bool(await self._eval(redis_scripts.SET_FIELDS, [keys.record(request_id)], args))

    def update_existing_call(
        self, key: str, fields: dict[str, str | int | float]
    ) -> tuple[str, list[str], list[str]]:
        """For ``eval_many``: write ``fields`` into the hash ``key`` only if it exists."""
        return redis_scripts.UPDATE_EXISTING, [key], [str(v) for kv in fields.items() for v in kv]

    async def update_existing(self, key: str, fields: dict[str, str | int | float]) -> bool:
        """Write ``fields`` into the hash ``key`` if it exists (it keeps its TTL); False when it is gone."""
        return bool(await self._eval(*self.update_existing_call(key, fields)))

    async def get_record(self, request_id: str) -> dict[str, str] | None:
        record = await self.client.hgetall(keys.record(request_id))
        return {str(k): str(v) for k, v in record.items()} or None

    async def read_log(self, request_id: str) -> list[Event]:
        return [decode_event(raw) for raw in await self.client.lrange(keys.log(request_id), 0, -1)]

    # ---- cancellation (gateway) ------------------------------------------------------------
    async def cancel(self, request_id: str, cancel_ttl_s: int) -> str:
        """Cancel wherever the request is; returns 'unknown', 'cancelling' or the terminal status."""
        done = encode_event(DoneEvent(id=request_id, seq=1, status=CANCELLED, code="cancelled"))
        args = [cancel_ttl_s, keys.events(request_id), done, f"{time.time():.6f}"]
        status = str(await self._eval(redis_scripts.CANCEL, keys.request_keys(request_id), args))
        if status in ("cancelled", "cancelling"):
            await self.client.zrem(keys.PENDING, request_id)
        if status == "cancelling":
            await self.client.publish(keys.CANCEL_CHANNEL, CancelMessage(request_id).encode())
        return status

    async def fail_queued(self, request_id: str, message: str, code: str) -> bool:
        """Fail a request no worker has started (its message is gone); False if one started it."""
        done = encode_event(DoneEvent(id=request_id, seq=1, status=FAILED, error=message, code=code))
        args = [keys.events(request_id), done, f"{time.time():.6f}", message, code]
        failed = bool(await self._eval(redis_scripts.FAIL_QUEUED, keys.request_keys(request_id), args))
        await self.client.zrem(keys.PENDING, request_id)
        return failed

    # ---- the worker's side -----------------------------------------------------------------
    async def start(self, request_id: str, worker: str, lease_s: float, seed: int, ttl_s: int) -> StartResult:
        """Take the request (it leaves the pending set) and claim it, in one round trip."""
        args = [worker, int(lease_s * 1000), seed, ttl_s, f"{time.time():.6f}"]
        (reply,) = await self.eval_many(
            [(redis_scripts.START, keys.request_keys(request_id), args)],
            before=[lambda p: p.zrem(keys.PENDING, request_id)],
        )
        outcome = str(reply[0])
        if outcome != "ok":
            return StartResult(outcome, status=str(reply[1]))
        events = [decode_event(raw) for raw in reply[4:]]
        return StartResult(
            "ok", seed=int(reply[1]), cancelled=bool(int(reply[2])), epoch=int(reply[3]), events=events
        )

    def publish_call(
        self,
        request_id: str,
        worker: str,
        lease_s: float,
        ttl_s: int,
        events: Sequence[str],
        *,
        epoch: int,
        final: bool = False,
        fields: dict[str, Any] | None = None,
    ) -> tuple[str, list[str], list[Any]]:
        """One PUBLISH script call, for ``eval_many``: events (encoded) to log and channel, atomically.

        ``epoch``: the claim's (``StartResult.epoch``); the script refuses the call (0) when another
        claim came since or the request is terminal."""
        flat = [str(v) for kv in (fields or {}).items() for v in kv]
        args = [
            worker,
            int(lease_s * 1000),
            ttl_s,
            keys.events(request_id),
            int(final),
            epoch,
            len(flat),
            *flat,
            *events,
        ]
        return redis_scripts.PUBLISH, keys.request_keys(request_id), args

    async def refresh_leases(self, held: Sequence[tuple[str, int]], worker: str, lease_s: float) -> set[str]:
        """Extend this worker's leases, given as (request id, epoch); returns the ids it may no longer
        write: lost to another claim, or terminal (finished by someone else)."""
        lease_ms = int(lease_s * 1000)
        calls = [
            (redis_scripts.REFRESH_LEASE, [keys.record(i), keys.owner(i)], [worker, lease_ms, epoch])
            for i, epoch in held
        ]
        results = await self.eval_many(calls) if calls else []
        return {i for (i, _), ok in zip(held, results, strict=True) if int(ok) != 1}

    async def release(self, request_id: str, worker: str, epoch: int) -> None:
        await self._eval(
            redis_scripts.RELEASE, [keys.record(request_id), keys.owner(request_id)], [worker, epoch]
        )

    async def owner(self, request_id: str) -> str | None:
        value = await self.client.get(keys.owner(request_id))
        return None if value is None else str(value)

    async def is_cancelled(self, request_id: str) -> bool:
        return bool(await self.client.exists(keys.cancel(request_id)))
