"""A burst of concurrent requests past each process's Redis connection bound: every request queues for
a connection and completes; none is answered 503. redis-py's default pool raised at its 100th
concurrent command instead, and a burst of 256 streaming requests on one gateway got 503s from a
healthy Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess
from tests.services.stack import MODEL_NAME, new_stack

pytestmark = pytest.mark.timeout(240)

BURST = 48
POOL = 3  # connections per process: the gateway's token hub keeps one for its subscription


async def _burst(url: str) -> list[tuple[int, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=BURST)) as c:

        async def one(i: int) -> tuple[int, Any]:
            body = {"model": MODEL_NAME, "prompt": f"burst {i}", "max_tokens": 4, "ignore_eos": True}
            resp = await c.post("/v1/completions", json=body)
            return resp.status_code, resp.json()

        return list(await asyncio.gather(*(one(i) for i in range(BURST))))


def test_a_burst_past_the_redis_pool_completes(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    stack = new_stack(kafka, redis_server, model_path, tmp_path, INFLIGHT_REDIS_MAX_CONNECTIONS=str(POOL))
    try:
        answers = asyncio.run(_burst(stack.url))
        statuses = [status for status, _ in answers]
        assert statuses == [200] * BURST, [body for status, body in answers if status != 200][:3]
        assert all(body["usage"]["completion_tokens"] == 4 for _, body in answers)
    finally:
        stack.close()
