"""The neighbours of a poison request are not failed with it: after one engine death, each request that
engine held runs alone on its next engine (services/worker/quarantine.py).

Real services: the broker, Redis, a gateway through uvicorn and three worker processes with their engine
cores, on a topic of one partition, so both requests land on the same worker and share its engine. A
watcher SIGKILLs the engine core of whichever worker is generating the culprit (it has published a
token). The first death counts against both requests; from then on only the culprit is in the engine when
it dies. Without the quarantine the two resume together on the next worker, the second death counts
against both, and the neighbour is failed with the culprit at the bound of 2. The engines are paced
(``INFLIGHT_FAULT_STEP_DELAY_S``): the neighbour is still running when the culprit's first token comes,
whatever the host's speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess
from services.common import keys
from tests.services.engine_killer import EngineKiller, poison_stack
from tests.services.stack import MODEL_NAME, Stack, wait_for

pytestmark = pytest.mark.timeout(300)

BOUND = 2
CULPRIT: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "Once upon a time, in a small village near the sea, there lived",
    "max_tokens": 200,  # at 0.05 s a step, at least 10 s: each kill finds it running
    "temperature": 0.9,
    "seed": 99,
    "ignore_eos": True,
}
# At least 12 s of steps: still running when the culprit, sent after its first token, starts.
NEIGHBOUR = {**CULPRIT, "prompt": "The weather report for tomorrow says", "max_tokens": 240, "seed": 7}


@pytest.fixture
def stack(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> Iterator[Stack]:
    s = poison_stack(kafka, redis_server, model_path, tmp_path, BOUND, INFLIGHT_KAFKA_PARTITIONS="1")
    yield s
    s.close()


def _submit(stack: Stack, body: dict[str, Any]) -> str:
    resp = httpx.post(f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30)
    assert resp.status_code in (200, 202), resp.text
    return str(resp.json()["id"])


def _ended(stack: Stack, job_id: str) -> dict[str, Any] | None:
    view: dict[str, Any] = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=10).json()
    return view if view["status"] in ("completed", "failed", "cancelled") else None


def test_the_neighbour_of_a_poison_request_completes(stack: Stack) -> None:
    redis = stack.redis_client()
    killer = EngineKiller(stack)
    try:
        neighbour = _submit(stack, NEIGHBOUR)
        wait_for(lambda: redis.llen(keys.log(neighbour)) > 0, 120, message="the neighbour's first token")
        culprit = _submit(stack, CULPRIT)
        killer.request_id = culprit
        culprit_view = wait_for(lambda: _ended(stack, culprit), 240, 0.5, "the culprit to end")
        neighbour_view = wait_for(lambda: _ended(stack, neighbour), 240, 0.5, "the neighbour to end")
    finally:
        killer.stop()
    assert culprit_view["status"] == "failed" and culprit_view["error"]["code"] == "engine_failed"
    assert len(killer.killed) == BOUND
    assert redis.hget(keys.record(culprit), "engine_failures") == str(BOUND)

    # The neighbour shared the first engine that died (one failure on its record), then ran alone and
    # completed: every token it was asked for, no error.
    assert redis.hget(keys.record(neighbour), "engine_failures") == "1"
    assert neighbour_view["status"] == "completed", neighbour_view
    choice = neighbour_view["result"]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert neighbour_view["result"]["usage"]["completion_tokens"] == NEIGHBOUR["max_tokens"]
    assert redis.zscore(keys.DEAD_LETTERS, neighbour) is None
    assert redis.zscore(keys.DEAD_LETTERS, culprit) is not None
