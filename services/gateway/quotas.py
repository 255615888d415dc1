"""Per-key job quotas: unfinished jobs (``INFLIGHT_MAX_JOBS_PER_KEY``) and stored jobs, finished ones
included (``INFLIGHT_MAX_STORED_JOBS_PER_KEY``), per API key.

Each key has two sorted sets in Redis, job id -> the time its record expires: its unfinished jobs and all
its jobs whose records are kept. Taking a slot is one script (drop expired ids, refuse at either cap, add
to both), atomic, so two gateways cannot both take the last slot. Finished jobs are not removed from the
unfinished set as they finish (the worker knows nothing of keys): only when a key is at that cap are its
jobs' records read, and the finished (or expired) ones dropped before one retry. So the usual submission
costs one round trip, and one at the cap a pipeline of cap reads. A stored job leaves its set when its
record expires; the set bounds what one key keeps in Redis (with the token log bound, settings.py).
"""

from __future__ import annotations

import time
from enum import Enum

import redis.asyncio as aioredis

from services.common import keys
from services.common.wire import TERMINAL

# KEYS: the key's unfinished set, its stored set. ARGV: now (ms), unfinished cap, job id, the job's
# expiry (ms), the sets' lifetime (ms), stored cap. Returns 1 (taken), 0 (unfinished cap), -1 (stored cap).
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[6]) then return -1 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1
"""


class Taken(Enum):
    OK = 1
    UNFINISHED_FULL = 0  # the key has its cap of unfinished jobs
    STORED_FULL = -1  # the key has its cap of kept records (finished ones until they expire)


def _jobs_of(owner: str) -> str:
    # Owners are digests of API keys (hex); without keys everyone is "" and shares one quota.
    return f"{keys.PREFIX}:jobs-of:{{{owner or 'anonymous'}}}"


def _stored_of(owner: str) -> str:
    return f"{keys.PREFIX}:stored-of:{{{owner or 'anonymous'}}}"


class JobQuota:
    def __init__(self, client: aioredis.Redis, cap: int, job_ttl_s: int, stored_cap: int) -> None:
        self.client = client
        self.cap = cap
        self.stored_cap = stored_cap
        self.job_ttl_s = job_ttl_s
        self._take = client.register_script(_TAKE)

    async def take(self, owner: str, job_id: str) -> Taken:
        """Count ``job_id`` against ``owner``'s quotas; nothing is counted unless ``Taken.OK``."""
        taken = await self._try(owner, job_id)
        if taken is not Taken.UNFINISHED_FULL:
            return taken
        await self._drop_finished(owner)
        return await self._try(owner, job_id)

    async def give_back(self, owner: str, job_id: str) -> None:
        """A job that was never enqueued (refused, or the broker failed): its slots are free again."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(_jobs_of(owner), job_id)
        pipe.zrem(_stored_of(owner), job_id)
        await pipe.execute()

    async def _try(self, owner: str, job_id: str) -> Taken:
        now_ms = int(time.time() * 1000)
        ttl_ms = self.job_ttl_s * 1000
        args: list[str | int] = [now_ms, self.cap, job_id, now_ms + ttl_ms, ttl_ms, self.stored_cap]
        return Taken(int(await self._take(keys=[_jobs_of(owner), _stored_of(owner)], args=args)))

    async def _drop_finished(self, owner: str) -> None:
        name = _jobs_of(owner)
        ids = [str(i) for i in await self.client.zrange(name, 0, -1)]
        if not ids:
            return
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(keys.record(job_id), "status")
        statuses = await pipe.execute()
        done = [i for i, status in zip(ids, statuses, strict=True) if status is None or status in TERMINAL]
        if done:
            await self.client.zrem(name, *done)
