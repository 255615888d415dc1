"""Per-key job quota: how many unfinished jobs one API key may have (``INFLIGHT_MAX_JOBS_PER_KEY``).

Each key has a sorted set in Redis, job id -> the time its record expires. Taking a slot is one script
(drop expired ids, refuse at the cap, add), atomic, so two gateways cannot both take the last slot.
Finished jobs are not removed as they finish (the worker knows nothing of keys): only when a key is
at its cap are its jobs' records read, and the finished (or expired) ones dropped before one retry.
So the usual submission costs one round trip, and one at the cap a pipeline of cap reads.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from services.common import keys
from services.common.wire import TERMINAL

# KEYS[1]: the key's job set. ARGV: now (ms), cap, job id, the job's expiry (ms), the set's lifetime (ms).
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""


def _jobs_of(owner: str) -> str:
    # Owners are digests of API keys (hex); without keys everyone is "" and shares one quota.
    return f"{keys.PREFIX}:jobs-of:{{{owner or 'anonymous'}}}"


class JobQuota:
    def __init__(self, client: aioredis.Redis, cap: int, job_ttl_s: int) -> None:
        self.client = client
        self.cap = cap
        self.job_ttl_s = job_ttl_s
        self._take = client.register_script(_TAKE)

    async def take(self, owner: str, job_id: str) -> bool:
        """Count ``job_id`` against ``owner``'s quota; False (nothing counted) when it is full."""
        if await self._try(owner, job_id):
            return True
        await self._drop_finished(owner)
        return await self._try(owner, job_id)

    async def give_back(self, owner: str, job_id: str) -> None:
        """A job that was never enqueued (refused, or the broker failed): its slot is free again."""
        await self.client.zrem(_jobs_of(owner), job_id)

    async def _try(self, owner: str, job_id: str) -> bool:
        now_ms = int(time.time() * 1000)
        ttl_ms = self.job_ttl_s * 1000
        args: list[str | int] = [now_ms, self.cap, job_id, now_ms + ttl_ms, ttl_ms]
        return bool(await self._take(keys=[_jobs_of(owner)], args=args))

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
