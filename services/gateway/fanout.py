"""Several prompts of one completions request read as one request: a batched ``prompt`` runs as one engine
request per prompt, and their token streams are merged here.

Choice ``j`` of prompt ``p`` is choice ``p * n + j`` of the response, as OpenAI numbers them. With two
prompts and n = 2:

    prompt 0: engine choices 0, 1  -> response choices 0, 1
    prompt 1: engine choices 0, 1  -> response choices 2, 3

The request is done when every prompt's is; its usage is their sum, and it failed if any of them did
(the first failure is the answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from services.common.wire import COMPLETED, DeltaEvent, DoneEvent, Event
from services.gateway.token_streams import FLUSH, Flush, StreamError, Subscription


def renumber(event: DeltaEvent, prompt_index: int, n: int) -> DeltaEvent:
    return dataclasses.replace(event, index=prompt_index * n + event.index)


def combine(done: list[DoneEvent]) -> DoneEvent:
    """One DoneEvent for the whole request: the first failure (or cancel) if any, usage summed."""
    failed = next((d for d in done if d.status != COMPLETED), None)
    head = failed or done[0]
    return dataclasses.replace(
        head,
        prompt_tokens=sum(d.prompt_tokens for d in done),
        completion_tokens=sum(d.completion_tokens for d in done),
        cached_tokens=sum(d.cached_tokens for d in done),
        # One list per prompt, in prompt order (present only when every prompt's is).
        prompt_logprobs=(
            [lp for d in done for lp in d.prompt_logprobs or []]
            if all(d.prompt_logprobs is not None for d in done)
            else None
        ),
    )


def events(
    subs: list[Subscription], n: int, idle_timeout_s: float, *, flush: bool = False
) -> AsyncIterator[Event | Flush | None]:
    """Every prompt's events, choices renumbered, then one combined DoneEvent; ``Subscription.events``'s
    contract otherwise (None while idle, FLUSH before a wait with ``flush``, StreamError). One prompt (the
    usual case) is its subscription's own iterator: no extra hop per token."""
    if len(subs) == 1:
        return subs[0].events(idle_timeout_s, flush=True) if flush else subs[0].events(idle_timeout_s)
    return _merged(subs, n, idle_timeout_s, flush)


async def _merged(
    subs: list[Subscription], n: int, idle_timeout_s: float, flush: bool
) -> AsyncIterator[Event | Flush | None]:
    queue: asyncio.Queue[tuple[int, Event | None] | StreamError] = asyncio.Queue()

    async def pump(p: int, sub: Subscription) -> None:
        try:
            async for event in sub.events(idle_timeout_s):
                if event is not None or p == 0:  # one idle tick for all, not one per prompt
                    queue.put_nowait((p, event))
        except StreamError as exc:
            queue.put_nowait(exc)

    pumps = [asyncio.ensure_future(pump(p, sub)) for p, sub in enumerate(subs)]
    done: dict[int, DoneEvent] = {}
    try:
        while len(done) < len(subs):
            if queue.empty() and flush:
                yield FLUSH
            item = await queue.get()
            if isinstance(item, StreamError):
                raise item
            p, event = item
            if isinstance(event, DoneEvent):
                done[p] = event
            elif isinstance(event, DeltaEvent):
                yield renumber(event, p, n)
            else:
                yield None
        yield combine([done[p] for p in range(len(subs))])
    finally:
        for task in pumps:  # not awaited: this also runs when the client's disconnect cancels the stream
            task.cancel()
