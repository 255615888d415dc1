"""InprocClient: streaming deltas, abort, and a step loop that never blocks the event loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.core.inproc_client import InprocClient
from engine.inputs import EngineRequest
from engine.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture
async def engine(tiny_llama_path: Path):  # type: ignore[no-untyped-def]
    eng = InprocClient.from_engine_args(str(tiny_llama_path), block_size=8, max_model_len=256)
    await eng.start()
    yield eng
    await eng.shutdown()


async def kv_clean(eng: InprocClient) -> bool:
    def check() -> bool:
        eng.engine.kv.check_integrity()
        return eng.engine.kv.num_free_blocks == eng.engine.kv.num_total_blocks

    return bool(await eng.run_on_engine_thread(check))


async def test_stream_deltas_add_up_to_the_offline_result(
    engine: InprocClient, tiny_llama_path: Path
) -> None:
    prompt = "streaming is the point"
    deltas = [out async for out in engine.generate(EngineRequest("s1", prompt, GREEDY))]
    tokens = [t for d in deltas for c in d.outputs for t in c.token_ids]
    text = "".join(c.text for d in deltas for c in d.outputs)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert deltas[-1].outputs[0].finish_reason == "length"
    offline = LLM(str(tiny_llama_path), block_size=8).generate([prompt], GREEDY)[0].outputs[0]
    assert tokens == offline.token_ids and text == offline.text
    assert await kv_clean(engine)


async def test_concurrent_streams(engine: InprocClient) -> None:
    async def run(i: int) -> int:
        n = 0
        async for out in engine.generate(EngineRequest(f"c{i}", [10 + i, 11, 12], GREEDY)):
            n += sum(len(c.token_ids) for c in out.outputs)
        return n

    counts = await asyncio.gather(*(run(i) for i in range(6)))
    assert counts == [10] * 6
    assert await kv_clean(engine)


async def test_abort_mid_stream_frees_blocks(engine: InprocClient) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    seen = 0
    last = None
    async for out in engine.generate(EngineRequest("victim", [5] * 40, params)):
        seen += 1
        last = out
        if seen == 3:
            await engine.abort("victim")
    assert last is not None and last.finished
    assert last.outputs[0].finish_reason == "abort"
    assert await kv_clean(engine)


async def test_leaving_the_iterator_early_aborts(engine: InprocClient) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    gen = engine.generate(EngineRequest("quitter", [6] * 30, params))
    await gen.__anext__()
    await gen.aclose()  # a disconnected client
    for _ in range(100):
        if await kv_clean(engine) and not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.02)
    assert await kv_clean(engine)


async def test_bad_input_raises_to_the_caller(engine: InprocClient) -> None:
    with pytest.raises(ValueError, match="empty"):
        async for _ in engine.generate(EngineRequest("bad", [], GREEDY)):
            pass
    gen = engine.generate(EngineRequest("same", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    await gen.__anext__()
    with pytest.raises(ValueError, match="already in flight"):
        async for _ in engine.generate(EngineRequest("same", [1, 2], GREEDY)):
            pass
    await gen.aclose()


async def test_event_loop_keeps_ticking_during_slow_steps(engine: InprocClient) -> None:
    """A model step that takes 200 ms must not stall the event loop (Kafka heartbeats live there)."""
    runner = engine.engine.runner
    # The forward: both the synchronous step and async scheduling's device side run it.
    real = runner.forward

    def slow_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.2)
        return real(*args, **kwargs)

    runner.forward = slow_forward  # type: ignore[method-assign]
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    try:
        async for _ in engine.generate(
            EngineRequest("slow", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        ):
            pass
    finally:
        done.set()
        await task
        runner.forward = real  # type: ignore[method-assign]
    assert len(gaps) > 20
    assert max(gaps) < 0.15, f"event loop stalled for {max(gaps):.3f}s"
