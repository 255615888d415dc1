"""The worker's Publisher and Runner in this process, against a real Redis and the real tiny engine.

The stack tests drive them through Kafka and HTTP; these pin what each part does on its own: what
reaches the Redis log, in which order and numbering, and how a run ends (done, skipped, fenced, failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from aiokafka.structs import TopicPartition

from engine.core.inproc_client import InprocClient
from engine.inputs import EngineRequest
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from harness.servers import ServerProcess
from services.common import keys
from services.common.settings import Settings
from services.common.store import Store, connect_redis
from services.common.wire import COMPLETED, DeltaEvent, DoneEvent, RequestMessage, encode_event
from services.common.wire_sampling import WireSampling
from services.worker.publisher import HOLD_S, Publisher, PublishError
from services.worker.request_runner import Runner
from services.worker.run_state import Final, Outcome, PendingDelta, Run
from services.worker.worker import Worker
from tests.services.stack import REDIS_PASSWORD

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass
class Parts:
    settings: Settings
    store: Store
    publisher: Publisher
    fenced: list[Run]


@pytest.fixture
async def parts(redis_server: ServerProcess) -> AsyncIterator[Parts]:
    settings = Settings(redis_url=redis_server.url, redis_password=REDIS_PASSWORD, lease_ttl_s=5)
    store = Store(connect_redis(settings))
    fenced: list[Run] = []
    publisher = Publisher(store, settings, on_fenced=fenced.append)
    task = asyncio.create_task(publisher.run_forever())
    yield Parts(settings, store, publisher, fenced)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await store.client.aclose()


@pytest.fixture(scope="module")
def loaded(model_path: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(str(model_path), max_model_len=256)  # loaded once per module


@pytest.fixture
async def engine(loaded: LLMEngine) -> AsyncIterator[InprocClient]:
    eng = InprocClient(loaded)  # its loop thread lives on this test's event loop
    await eng.start()
    yield eng
    await eng.shutdown()


def _message(params: SamplingParams, **fields: object) -> RequestMessage:
    base: dict[str, object] = {
        "id": f"cmpl-{uuid.uuid4().hex[:10]}",
        "kind": "completion",
        "model": "tiny",
        "prompt_token_ids": [5, 6, 7, 8, 9],
        "params": WireSampling.from_params(params),
        "created": time.time(),  # a message older than its record's lifetime is skipped, never run
    }
    return RequestMessage(**{**base, **fields})  # type: ignore[arg-type]


async def _admitted(p: Parts, msg: RequestMessage) -> Run:
    await p.store.admit_and_record(msg.id, 100, 30, {"kind": msg.kind}, 60)
    return Run(msg, prompt_token_ids=list(msg.prompt_token_ids))


async def test_publisher_merges_numbers_and_finishes_in_order(parts: Parts) -> None:
    p, worker = parts, parts.settings.worker_id
    run = await _admitted(p, _message(SamplingParams()))
    start = await p.store.start(run.id, worker, lease_s=5, seed=1, ttl_s=60)
    assert start.outcome == "ok"
    run.holds_lease, run.epoch = True, start.epoch
    # Three deltas queued before the publisher gets to run: one event, one round trip.
    trips = p.publisher.num_round_trips
    for token, text in ((11, "a"), (12, "b"), (13, "c")):
        p.publisher.emit(run, PendingDelta(0, [token], text))
    p.publisher.emit(run, PendingDelta(0, [14], "d", "length"), last=True)
    await p.publisher.finish(run, Final(COMPLETED, fields={"status": COMPLETED}))
    log = await p.store.read_log(run.id)
    assert [type(e) for e in log] == [DeltaEvent, DoneEvent]
    delta, done = log
    assert isinstance(delta, DeltaEvent) and isinstance(done, DoneEvent)
    assert (delta.seq, delta.token_ids, delta.text, delta.finish_reason) == (
        1,
        [11, 12, 13, 14],
        "abcd",
        "length",
    )
    assert (done.seq, done.status, done.prompt_tokens, done.completion_tokens) == (2, COMPLETED, 5, 4)
    assert p.publisher.num_round_trips - trips == 1  # the last delta waited for the done event
    record = await p.store.get_record(run.id)
    assert record is not None and record["status"] == COMPLETED
    assert await p.store.owner(run.id) is None and not run.holds_lease
    assert list(run.output.choices) == [0] and run.output.choice(0).token_ids == [11, 12, 13, 14]
    assert p.fenced == []


async def test_publisher_holds_back_what_nobody_streams(parts: Parts) -> None:
    """A whole-response request's deltas wait (at most HOLD_S) and go out with its finish; a
    streamed one's go out as they come."""
    p, worker = parts, parts.settings.worker_id
    whole = await _admitted(p, _message(SamplingParams(), stream=False))
    streamed = await _admitted(p, _message(SamplingParams(), stream=True))
    for run in (whole, streamed):
        start = await p.store.start(run.id, worker, lease_s=5, seed=1, ttl_s=60)
        assert start.outcome == "ok"
        run.holds_lease, run.epoch = True, start.epoch
    trips = p.publisher.num_round_trips
    for token in range(8):
        p.publisher.emit(whole, PendingDelta(0, [token], "x"))
        await asyncio.sleep(0.005)  # a step's time apart, as an engine produces them
    assert await p.store.read_log(whole.id) == []  # held back
    assert p.publisher.num_round_trips == trips
    await p.publisher.finish(whole, Final(COMPLETED, fields={"status": COMPLETED}))
    log = await p.store.read_log(whole.id)
    assert [type(e) for e in log] == [DeltaEvent, DoneEvent]
    assert isinstance(log[0], DeltaEvent) and log[0].token_ids == list(range(8))
    assert p.publisher.num_round_trips - trips == 1

    p.publisher.emit(streamed, PendingDelta(0, [1], "a"))
    for _ in range(100):
        if await p.store.read_log(streamed.id):
            break
        await asyncio.sleep(0.005)
    assert len(await p.store.read_log(streamed.id)) == 1  # sent without waiting for anything

    # Held back, but not for ever: the timer sends it (progress, and little lost to a crash).
    long = await _admitted(p, _message(SamplingParams(), stream=False))
    start = await p.store.start(long.id, worker, lease_s=5, seed=1, ttl_s=60)
    assert start.outcome == "ok"
    long.holds_lease, long.epoch = True, start.epoch
    began = time.monotonic()
    p.publisher.emit(long, PendingDelta(0, [7], "y"))
    while not await p.store.read_log(long.id):
        assert time.monotonic() - began < HOLD_S + 1.0
        await asyncio.sleep(0.01)


async def test_publisher_fences_a_run_whose_lease_moved(parts: Parts) -> None:
    p = parts
    run = await _admitted(p, _message(SamplingParams()))
    run.epoch = (await p.store.start(run.id, p.settings.worker_id, lease_s=5, seed=1, ttl_s=60)).epoch
    await p.store.client.delete(keys.owner(run.id))  # this worker's lease lapsed...
    assert (await p.store.start(run.id, "other-worker", lease_s=5, seed=1, ttl_s=60)).outcome == "ok"
    p.publisher.emit(run, PendingDelta(0, [11], "a"))
    for _ in range(100):
        if p.fenced:
            break
        await asyncio.sleep(0.01)
    assert p.fenced == [run]  # ...so its events are refused and the worker is told to stop it
    with pytest.raises(PublishError):
        await p.publisher.finish(run, Final(COMPLETED))
    assert await p.store.read_log(run.id) == []


async def test_runner_generates_every_index_as_the_engine_would(parts: Parts, engine: InprocClient) -> None:
    p = parts
    params = SamplingParams(n=2, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True)
    run = await _admitted(p, _message(params))
    outcome = await Runner(engine, p.store, p.publisher, p.settings).execute(run)
    assert outcome is Outcome.DONE
    # The same completions straight from the engine: index i is one request with seed + i.
    for index in range(2):
        one = dataclasses.replace(params, n=1, seed=7 + index)
        request = EngineRequest(f"direct-{run.id}-{index}", [5, 6, 7, 8, 9], one)
        direct = [t async for o in engine.generate(request) for t in o.outputs[0].token_ids]
        assert run.output.choice(index).token_ids == direct
    log = await p.store.read_log(run.id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    done = log[-1]
    assert isinstance(done, DoneEvent) and (done.status, done.completion_tokens) == (COMPLETED, 12)
    record = await p.store.get_record(run.id)
    assert record is not None
    choices = json.loads(record["result"])["choices"]
    assert [(c["index"], c["num_tokens"], c["finish_reason"]) for c in choices] == [
        (0, 6, "length"),
        (1, 6, "length"),
    ]
    # A redelivery of the finished request is never run again.
    again = Run(run.msg, prompt_token_ids=list(run.msg.prompt_token_ids))
    assert await Runner(engine, p.store, p.publisher, p.settings).execute(again) is Outcome.SKIPPED


async def test_runner_resumes_a_dead_workers_stream(parts: Parts, engine: InprocClient) -> None:
    p = parts
    params = SamplingParams(seed=3, temperature=1.0, max_tokens=8, ignore_eos=True)
    request = EngineRequest(f"whole-{uuid.uuid4().hex}", [5, 6, 7, 8, 9], params)
    whole = [t async for o in engine.generate(request) for t in o.outputs[0].token_ids]
    run = await _admitted(p, _message(params))
    # A worker that died after publishing three tokens: its events are in the log, its lease is gone.
    dead = await p.store.start(run.id, "dead-worker", lease_s=5, seed=99, ttl_s=60)
    early = DeltaEvent(run.id, 1, 0, whole[:3], "", worker="dead-worker")
    call = p.store.publish_call(run.id, "dead-worker", 5, 60, [encode_event(early)], epoch=dead.epoch)
    await p.store.eval_many([call])
    await p.store.client.delete(keys.owner(run.id))
    assert await Runner(engine, p.store, p.publisher, p.settings).execute(run) is Outcome.DONE
    assert run.resumed_from == 3
    assert run.output.choice(0).token_ids == whole  # the continuation is the uninterrupted run's
    log = await p.store.read_log(run.id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    assert all(e.worker == p.settings.worker_id for e in log[1:])


async def test_runner_fails_a_prompt_longer_than_the_model(parts: Parts, engine: InprocClient) -> None:
    p = parts
    run = await _admitted(
        p, _message(SamplingParams(max_tokens=4), prompt_token_ids=[], prompt="word " * 400)
    )
    assert await Runner(engine, p.store, p.publisher, p.settings).execute(run) is Outcome.DONE
    (done,) = await p.store.read_log(run.id)
    assert isinstance(done, DoneEvent) and (done.status, done.code) == ("failed", "invalid_request")
    assert "maximum context length (max_model_len) is 256" in (done.error or "")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
async def test_runner_renders_chat_as_the_client_asked(
    parts: Parts, engine: InprocClient, add_generation_prompt: bool
) -> None:
    """The text path (a gateway without the model): the worker renders the messages, honouring
    add_generation_prompt (it used to render every chat with True)."""
    p = parts
    messages = [{"role": "user", "content": "hello there"}]
    msg = _message(
        SamplingParams(max_tokens=2, ignore_eos=True),
        kind="chat",
        prompt_token_ids=[],
        messages=messages,
        add_generation_prompt=add_generation_prompt,
    )
    run = await _admitted(p, msg)
    assert await Runner(engine, p.store, p.publisher, p.settings).execute(run) is Outcome.DONE
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert run.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert rendered.endswith("<|im_start|>assistant\n") is add_generation_prompt


async def test_runner_renders_chat_off_its_event_loop_within_the_message_bound(
    parts: Parts, engine: InprocClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat template renders on the runner's prompt thread, never the worker's loop (which renews
    leases and heartbeats); more messages than INFLIGHT_MAX_MESSAGES are refused before any render."""
    p = parts
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    threads: list[str] = []
    render = tokenizer.apply_chat_template

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", recorded)
    settings = dataclasses.replace(p.settings, max_messages=3)
    runner = Runner(engine, p.store, p.publisher, settings)
    chat: dict[str, Any] = {"kind": "chat", "prompt_token_ids": []}
    ok = await _admitted(
        p, _message(SamplingParams(max_tokens=2), **chat, messages=[{"role": "user", "content": "hi"}] * 3)
    )
    assert await runner.execute(ok) is Outcome.DONE
    assert threads and all(name.startswith("inflight-prompt") for name in threads), threads
    assert ok.prompt_token_ids
    threads.clear()
    over = await _admitted(
        p, _message(SamplingParams(max_tokens=2), **chat, messages=[{"role": "user", "content": ""}] * 4)
    )
    assert await runner.execute(over) is Outcome.DONE
    (done,) = await p.store.read_log(over.id)
    assert isinstance(done, DoneEvent) and (done.code, done.param) == ("invalid_request", "messages")
    assert "4 messages, more than the 3" in (done.error or "")
    assert threads == []  # refused before rendering


async def test_runner_resumes_n_completions_each_from_its_own_point(
    parts: Parts, engine: InprocClient
) -> None:
    """n > 1 is one engine request (the engine fans out); a resume hands it each index's tokens and
    leaves out the indexes that had finished."""
    p = parts
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)
    whole = await _admitted(p, _message(params))
    assert await Runner(engine, p.store, p.publisher, p.settings).execute(whole) is Outcome.DONE
    expected = {i: whole.output.choice(i).token_ids for i in range(3)}
    run = await _admitted(p, _message(params))
    # A dead worker's log: index 1 finished, index 0 three tokens in, index 2 not started.
    dead = await p.store.start(run.id, "dead-worker", lease_s=5, seed=99, ttl_s=60)
    early = [
        DeltaEvent(run.id, 1, 1, expected[1], "", "length", worker="dead-worker"),
        DeltaEvent(run.id, 2, 0, expected[0][:3], "", worker="dead-worker"),
    ]
    logged = [encode_event(e) for e in early]
    await p.store.eval_many([p.store.publish_call(run.id, "dead-worker", 5, 60, logged, epoch=dead.epoch)])
    await p.store.client.delete(keys.owner(run.id))
    seen: list[tuple[str, list[int] | None]] = []
    real_generate = engine.generate

    def spy(request: EngineRequest) -> AsyncIterator[RequestOutput]:
        seen.append((request.request_id, request.indexes))
        return real_generate(request)

    engine.generate = spy  # type: ignore[method-assign]
    try:
        assert await Runner(engine, p.store, p.publisher, p.settings).execute(run) is Outcome.DONE
    finally:
        engine.generate = real_generate  # type: ignore[method-assign]
    assert seen == [(run.id, [0, 2])]  # one engine request, the finished index left out
    assert {i: run.output.choice(i).token_ids for i in range(3)} == expected
    log = await p.store.read_log(run.id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    done = log[-1]
    assert isinstance(done, DoneEvent) and done.completion_tokens == 18


@pytest.mark.parametrize(("failures", "status"), [(2, "completed"), (3, "failed")])
async def test_a_run_that_raises_keeps_its_offset_until_its_record_is_terminal(
    parts: Parts, engine: InprocClient, failures: int, status: str
) -> None:
    """Any exception in a run (a bug, here after the claim) leaves its record "in_progress": the run is
    tried again from the log, and its offset is released only once the record is terminal (it used to be
    released at the first exception, the request lost). A run the worker keeps failing is failed for good."""
    worker = Worker(parts.settings, engine)
    publishing = asyncio.create_task(worker.publisher.run_forever())
    sync_redis = redis_lib.Redis.from_url(
        parts.settings.redis_url, password=REDIS_PASSWORD, decode_responses=True
    )
    msg = _message(SamplingParams(max_tokens=4, ignore_eos=True))
    released: list[str | None] = []  # the record's status whenever an offset is released
    tracker_done = worker.tracker.done

    def done(tp: TopicPartition, offset: int, generation: int) -> None:
        status = sync_redis.hget(keys.record(msg.id), "status")
        released.append(None if status is None else str(status))
        tracker_done(tp, offset, generation)

    left = failures
    resume = worker.runner._resume

    def flaky_resume(run: Run, events: list[Any]) -> None:
        nonlocal left
        if left:
            left -= 1
            raise KeyError("a bug in the worker")
        resume(run, events)

    worker.tracker.done = done  # type: ignore[method-assign]
    worker.runner._resume = flaky_resume  # type: ignore[method-assign]
    try:
        tp = TopicPartition("requests", 0)
        worker.tracker.reset([tp])
        run = await _admitted(parts, msg)
        run.deliveries.append((tp, 7, worker.tracker.add(tp, 7)))
        worker._start_run(run)
        assert run.task is not None
        assert await run.task is Outcome.DONE
        assert released == [status]
        assert worker.tracker.committable() == {tp: 8}
        record = await parts.store.get_record(msg.id)
        assert record is not None and record["epoch"] == str(failures + 1)  # claimed once per attempt
        if status == "failed":
            assert record["code"] == "worker_error"
        log = await parts.store.read_log(msg.id)
        assert [e.seq for e in log] == list(range(1, len(log) + 1))
        assert [type(e) for e in log if isinstance(e, DoneEvent)] == [DoneEvent]
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        await worker.store.client.aclose()
        sync_redis.close()
