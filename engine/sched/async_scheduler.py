"""The scheduler for async scheduling: it plans step N+1 before step N's sampled tokens are known.

The engine calls ``schedule()`` for step N+1 while step N still runs, and ``update_from_output`` for
step N afterwards. So progress is committed when a step is scheduled, not when it reports:

  * ``num_computed_tokens`` advances by the step's scheduled tokens as soon as it is scheduled;
  * a request whose step reaches its last token will sample one: it gets a placeholder
    (``num_output_placeholders`` += 1), and the next schedule plans its decode as if the token were
    there (the runner feeds the real token to the model on the device, never through the host);
  * when the step reports, each placeholder becomes the sampled token, then the usual stop check.

Example: A holds 6 known tokens (prompt 5, one output), 5 of them computed; steps N and N+1 overlap.
    schedule N     decode position 5: computed 5 -> 6 = 6 known + 0 pending, so it samples:
                   placeholders 0 -> 1
    schedule N+1   target 6 known + 1 pending = 7: decode position 6 (its input is N's token, fed
                   on the device): computed 6 -> 7, placeholders 1 -> 2
    report N       token 7 arrives: 7 known, placeholders 2 -> 1. EOS? A finishes now, its blocks are
                   freed, and step N+1's token for it (being computed) is dropped when N+1 reports.

What the one-step lag costs and how it stays exact:
  * A request whose pending token is its last by count (max_tokens, max_model_len) is not scheduled
    again: nothing of it would be kept.
  * One that stops on a token's value (EOS, stop token, stop string) runs one wasted decode; its
    blocks are freed when the stop is seen. The wasted step still writes K/V into them, but every
    later step that could reuse those blocks runs after it on the same stream (or worker thread).
  * A request preempted while its token is in flight waits until the token arrives before it can be
    readmitted (its recompute needs every token).
  * Greedy and seeded outputs are the synchronous path's: sampling depends only on (seed, position)
    and the tokens, never on which step a request shares or when the host learns a token.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.cost_model import StepCostModel
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sched.output import SchedulerOutput
from engine.sched.policy import SchedulingPolicy
from engine.sched.scheduler import Scheduler
from engine.sched.tokens import add_token, check_stop, reaches_limit


@dataclass
class _InFlight:
    """A scheduled step whose tokens have not been reported yet."""

    out: SchedulerOutput
    requests: dict[str, Request]  # the scheduled requests as objects: an id may be reused meanwhile
    sampling: set[str]  # ids that got a placeholder in this step


class AsyncScheduler(Scheduler):
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        eos_token_ids: set[int],
        *,
        cost: StepCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        super().__init__(config, kv, eos_token_ids, cost=cost, clock=clock, policy=policy)
        self._in_flight: deque[_InFlight] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def _target_tokens(self, request: Request) -> int:
        pending = request.num_output_placeholders
        if pending and reaches_limit(request, self.config.max_model_len):
            return request.num_computed_tokens  # its pending token is its last: nothing to schedule
        return request.num_tokens + pending

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if out.is_empty:
            return out
        now = self.clock()
        step = _InFlight(out, {}, set())
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            prefilling = request.num_computed_tokens < request.num_prompt_tokens + request.num_resumed_tokens
            request.num_computed_tokens += num_scheduled
            if prefilling:
                computed = request.num_computed_tokens
                request.record("prefill_chunk", now, tokens=num_scheduled, computed=computed)
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
                step.sampling.add(req_id)
            step.requests[req_id] = request
        self._in_flight.append(step)
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Step ``out``'s tokens (steps report in the order they were scheduled). Requests that
        finished while it ran drop theirs. Returns the requests that received a token."""
        step = self._pop(out)
        now = self.clock()
        got_token = []
        for req_id, request in step.requests.items():
            if req_id not in step.sampling:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.num_output_placeholders -= 1
            if self.requests.get(req_id) is not request:
                continue  # aborted, stopped or failed while the step ran: nothing more is emitted
            token = sampled.get(req_id)
            if token is None:
                raise RuntimeError(f"step reported no token for {req_id}, which it had to sample")
            if request.timeline.prefill_done is None:
                request.timeline.prefill_done = now
            add_token(request, token, now)
            got_token.append(request)
            status = check_stop(request, token, self.eos_token_ids, self.config.max_model_len)
            if status is not None:
                self.finish_request(req_id, status)  # running, or waiting if preempted meanwhile
        return got_token

    def discard(self, out: SchedulerOutput) -> None:
        """A step that will never report (it failed): release its placeholders."""
        step = self._pop(out)
        for req_id in step.sampling:
            step.requests[req_id].num_output_placeholders -= 1

    def _pop(self, out: SchedulerOutput) -> _InFlight:
        if not self._in_flight or self._in_flight[0].out is not out:
            raise RuntimeError("steps must report once each, in the order they were scheduled")
        return self._in_flight.popleft()
