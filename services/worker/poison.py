"""Poison requests: a request its engines keep dying or stalling under is failed, not passed on.

A claim that ends with its engine dead (a crash, the OOM killer, a stall the watchdog killed) hands the
request back, and another worker resumes it. A request that is itself the cause would take the fleet
down one engine at a time, so each such claim counts in the request's record (``engine_failures``,
written only while this claim is still the request's). The claim that reaches
``INFLIGHT_MAX_ENGINE_FAILURES`` fails it here for good, code ``engine_failed`` (an SSE error event for a
stream, status "failed" for a job): its record is terminal, so no worker claims it again. Operators see
it three ways: the ``inflight:request_engine_failures_total{outcome}`` counter, an error log line with
the request id, and a dead-letter record in Redis:

    ZRANGE inflight:dead 0 -1 WITHSCORES      ids, by when they failed
    HGETALL inflight:dead:{<id>}              what it was, how often engines died, its Kafka message

Every request on a dying engine counts, the culprit and its batch neighbours alike; from then on each
runs alone on its engine (quarantine.py), so further deaths count against the culprit only, and a
neighbour that was merely unlucky completes.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache

from prometheus_client import REGISTRY, Counter

from services.common import keys
from services.common.settings import Settings
from services.common.store import Store
from services.worker.run_state import Run

log = logging.getLogger(__name__)

# KEYS: record, owner. ARGV: worker, epoch. The request's engine failures after this one, or -1 when the
# claim is no longer this worker's (another claim since, another owner, or already terminal): a claim
# fenced off counts nothing, so one engine death is never counted twice.
COUNT_FAILURE = """
local state = redis.call('HMGET', KEYS[1], 'status', 'epoch')
if not state[1] or state[1] == 'completed' or state[1] == 'failed' or state[1] == 'cancelled' then
  return -1
end
if state[2] ~= ARGV[2] then return -1 end
local owner = redis.call('GET', KEYS[2])
if owner and owner ~= ARGV[1] then return -1 end
return redis.call('HINCRBY', KEYS[1], 'engine_failures', 1)
"""


@lru_cache(maxsize=1)
def engine_failures() -> Counter:
    """The counter, registered on the worker's first call (Worker.__init__): both series scrape as 0."""
    counter = Counter(
        keys.PREFIX + ":request_engine_failures",
        "Claims that ended with their engine dead or stalled, by what became of the request "
        "(handed_back: another engine resumes it; failed: past the bound, failed and dead-lettered)",
        ["outcome"],
        registry=REGISTRY,
    )
    for outcome in ("handed_back", "failed"):
        counter.labels(outcome)
    return counter


async def failed_before(store: Store, settings: Settings, run: Run) -> bool:
    """At a claim: True when earlier claims already reached the bound (the worker that counted the last
    one died before it could fail the request): the run is to be failed without an engine. Below the
    bound, a run with any engine failure is a suspect, to run alone (quarantine.py). Only a request
    claimed before (epoch > 1) can have engine failures, so a first claim costs no round trip."""
    if run.epoch <= 1:
        return False
    raw = await store.client.hget(keys.record(run.id), "engine_failures")
    failures = int(raw or 0)
    if failures < settings.max_engine_failures:
        run.suspect = failures > 0
        if run.suspect:
            log.info("request %s: %d engine failures on record, it runs alone", run.id, failures)
        return False
    await _fail(store, settings, run, failures)
    return True


async def fail_if_poison(store: Store, settings: Settings, run: Run) -> bool:
    """Count this claim's engine death against ``run``; True when that reaches the bound and the run is
    now to be failed (its error is recorded; the caller finishes it)."""
    args = [settings.worker_id, run.epoch]
    (failures,) = await store.eval_many([(COUNT_FAILURE, [keys.record(run.id), keys.owner(run.id)], args)])
    failures = int(failures)
    if failures < settings.max_engine_failures:
        if failures > 0:
            log.warning(
                "request %s: its engine died under it (%d of %d)",
                run.id,
                failures,
                settings.max_engine_failures,
            )
            engine_failures().labels("handed_back").inc()
        return False
    await _fail(store, settings, run, failures)
    return True


async def _fail(store: Store, settings: Settings, run: Run, failures: int) -> None:
    message = (
        f"engines died or stalled while running this request {failures} times "
        f"(INFLIGHT_MAX_ENGINE_FAILURES={settings.max_engine_failures}); it is not tried again"
    )
    run.state.fail(0, message, "engine_failed")
    await _dead_letter(store, settings, run, failures, message)
    engine_failures().labels("failed").inc()
    log.error(
        "request %s failed for good: %d engines died or stalled running it; dead letter %s",
        run.id,
        failures,
        keys.dead_letter(run.id),
    )


async def _dead_letter(store: Store, settings: Settings, run: Run, failures: int, message: str) -> None:
    """The record operators inspect: kept a day (``job_ttl_s``) whatever the request's own TTL, so a
    synchronous request's is still there when someone looks."""
    now = time.time()
    ttl = settings.job_ttl_s
    fields: dict[str, str | int | float] = {
        "id": run.id,
        "kind": run.msg.kind,
        "model": run.msg.model,
        "job": int(run.msg.job),
        "created": f"{run.msg.created:.6f}",
        "failed": f"{now:.6f}",
        "engine_failures": failures,
        "worker": settings.worker_id,
        "prompt_tokens": len(run.prompt_token_ids),
        "error": message,
    }
    if run.deliveries:  # where its message is, to read it again
        tp, offset, _ = run.deliveries[0]
        fields |= {"topic": tp.topic, "partition": tp.partition, "offset": offset}
    async with store.client.pipeline(transaction=False) as pipe:
        pipe.hset(keys.dead_letter(run.id), items=[v for kv in fields.items() for v in kv])
        pipe.expire(keys.dead_letter(run.id), ttl)
        pipe.zadd(keys.DEAD_LETTERS, {run.id: now})
        pipe.zremrangebyscore(keys.DEAD_LETTERS, 0, now - ttl)  # ids whose records have expired
        pipe.expire(keys.DEAD_LETTERS, ttl)
        await pipe.execute()
