"""An idle worker long-polls the broker instead of fetching every few milliseconds, and still takes a
request that arrives while it waits; with work in flight it is back to short fetches.

Unit: the wait follows the worker's work on a clock of the test's own. Then the paced stack's worker:
its /stats shows the long wait once idle, a request sent then streams to the end, and while that request
runs (paced: 64 steps of at least 20 ms each) the fetches are short again.
"""

from __future__ import annotations

from typing import Any

import httpx

from services.worker.fetch_wait import FetchWait
from tests.services.stack import MODEL_NAME, Stack, wait_for


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_wait_is_long_only_after_the_idle_spell_and_short_at_the_first_work() -> None:
    clock = _Clock()
    wait = FetchWait(busy_ms=5, idle_ms=500, idle_after_s=2.0, clock=clock)
    assert wait.update(busy=False) == 5  # just started: not idle for long yet
    clock.now += 1.9
    assert wait.update(busy=False) == 5
    clock.now += 0.1
    assert wait.update(busy=False) == 500
    assert wait.update(busy=True) == 5  # a record or a run: short at once
    clock.now += 1.0
    assert wait.update(busy=False) == 5  # the idle spell starts again from the last work
    clock.now += 1.0
    assert wait.update(busy=False) == 500
    never = FetchWait(busy_ms=5, idle_ms=0, idle_after_s=2.0, clock=clock)
    clock.now += 60.0
    assert never.update(busy=False) == 5  # 0: no long polls


def _worker_stats(stack: Stack) -> dict[str, Any]:
    return dict(httpx.get(f"{stack.workers[0].url}/stats", timeout=10).json())


def test_an_idle_worker_long_polls_and_still_takes_a_request(paced_stack: Stack) -> None:
    stack = paced_stack
    # Nothing in flight for two seconds: the worker's fetches wait 500 ms at the broker.
    wait_for(lambda: _worker_stats(stack)["fetch_wait_ms"] == 500, 60, 0.2, "the idle worker's long poll")
    stream = stack.client().completions.create(
        model=MODEL_NAME,
        prompt="idle worker",
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # taken from the long poll: the first token came
    # Still running (paced), so the worker has work: short fetches again, for the next arrival.
    running = _worker_stats(stack)
    assert running["requests"] and running["fetch_wait_ms"] == 5, running
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text  # streamed to the end (64 tokens)
