"""A deadline from the wire reaches the engine's slo policy, and a request it rejects ends as a failed
run with code slo_ttft_unmet, which the gateway answers as a retryable 503 (real Redis, tiny engine)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.core.inproc_client import InprocClient
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from harness.servers import ServerProcess
from services.common.settings import Settings
from services.common.store import Store, connect_redis
from services.common.wire import COMPLETED, DoneEvent, RequestMessage
from services.common.wire_sampling import WireSampling
from services.gateway.openai_routes import _done_error
from services.worker.publisher import Publisher
from services.worker.request_runner import Runner
from services.worker.run_state import Outcome, Run
from tests.services.stack import REDIS_PASSWORD

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def engine(model_path: Path) -> AsyncIterator[InprocClient]:
    loaded = LLMEngine.from_engine_args(
        str(model_path), max_model_len=256, scheduling_policy="slo", slo_reject=True
    )
    eng = InprocClient(loaded)
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_a_lost_deadline_fails_as_slo_ttft_unmet(
    redis_server: ServerProcess, engine: InprocClient
) -> None:
    settings = Settings(redis_url=redis_server.url, redis_password=REDIS_PASSWORD, lease_ttl_s=5)
    store = Store(connect_redis(settings))
    publisher = Publisher(store, settings, on_fenced=lambda run: None)
    task = asyncio.create_task(publisher.run_forever())
    try:
        done: dict[str, DoneEvent] = {}
        for name, ttft_ms in (("lost", 1e-6), ("kept", 60_000.0)):
            msg = RequestMessage(
                id=f"cmpl-{name}-{uuid.uuid4().hex[:8]}",
                kind="completion",
                model="tiny",
                prompt_token_ids=[5, 6, 7, 8, 9],
                params=WireSampling.from_params(SamplingParams(max_tokens=3, ignore_eos=True)),
                created=time.time(),
                slo_ttft_ms=ttft_ms,
            )
            decoded = RequestMessage.decode(msg.encode())  # as the worker gets it from Kafka
            await store.admit_and_record(msg.id, 100, 30, {"kind": msg.kind}, 60)
            run = Run(decoded, prompt_token_ids=list(decoded.prompt_token_ids))
            assert await Runner(engine, store, publisher, settings).execute(run) is Outcome.DONE
            last = (await store.read_log(msg.id))[-1]
            assert isinstance(last, DoneEvent)
            done[name] = last
        lost, kept = done["lost"], done["kept"]
        assert (lost.status, lost.code) == ("failed", "slo_ttft_unmet")
        assert (lost.error or "").startswith("slo_ttft_unmet: the time-to-first-token deadline")
        assert (kept.status, kept.completion_tokens) == (COMPLETED, 3)
        error = _done_error(lost)
        assert (error.status, error.code) == (503, "slo_ttft_unmet")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.client.aclose()
